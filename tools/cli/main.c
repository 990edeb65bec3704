/* The megatrain command: dispatches to a subcommand (one file each in tools/cli/), or prints
 * the list of them or the version. */
#include <stdio.h>
#include <string.h>

#include "mt_build_config.h"
#include "mt_commit.h"
#include "tools/cli/commands.h"

static const struct {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *what;
} commands[] = {
    { "train", cli_train, "train a model (default: the built-in byte-level model on fortunes)" },
    { "prepare", cli_prepare, "tokenise text or chat JSONL into token shards for train --data" },
    { "plan", cli_plan, "print the memory plan of a run and check that it fits" },
    { "bench", cli_bench, "time the training step of a published shape or a config.json (random weights)" },
    { "grads", cli_grads, "one batch's loss, logits and gradients as safetensors (parity with transformers)" },
    { "info", cli_info, "show StarPU's workers and check that every kind runs a task" },
    { "plot", cli_plot, "draw the loss and tokens/s of train --metrics files as a PNG (gnuplot)" },
    { "eval", cli_eval, "a model's validation loss and perplexity on prepared data or text" },
    { "generate", cli_generate, "continue a prompt with a model (greedy, temperature, top-p)" },
};
enum { NCOMMANDS = sizeof commands / sizeof commands[0] };

static void main_help(void)
{
    printf("usage: megatrain COMMAND [options]\n\n"
           "Trains LLMs that do not fit in GPU memory: host RAM holds every weight, gradient and\n"
           "AdamW state; layers stream through the GPU as a StarPU task graph.\n\n"
           "commands:\n");
    for (int k = 0; k < NCOMMANDS; k++) printf("  %-10s%s\n", commands[k].name, commands[k].what);
    printf("\n'megatrain COMMAND --help' describes each command, 'megatrain COMMAND --help-all' also its\n"
           "advanced options; 'megatrain help COMMAND' is 'megatrain COMMAND --help'.\n");
}

static int find_command(const char *name)
{
    for (int k = 0; k < NCOMMANDS; k++)
        if (!strcmp(name, commands[k].name)) return k;
    return -1;
}

static int unknown_command(const char *name)
{
    fprintf(stderr, "megatrain: unknown command '%s' (", name);
    for (int k = 0; k < NCOMMANDS; k++) fprintf(stderr, "%s%s", k ? ", " : "", commands[k].name);
    fprintf(stderr, ") (try 'megatrain --help')\n");
    return 2;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        main_help();
        return 2;
    }
    const char *sub = argv[1];
    if (!strcmp(sub, "--version")) {
        printf("megatrain %s (commit %s)\n", MT_VERSION, MT_COMMIT);
        return 0;
    }
    char *help_argv[3];
    if (!strcmp(sub, "--help") || !strcmp(sub, "-h") || !strcmp(sub, "help")) {
        if (argc < 3) {
            main_help();
            return 0;
        }
        /* help COMMAND: that command's --help */
        help_argv[0] = argv[0];
        help_argv[1] = argv[2];
        help_argv[2] = "--help";
        argv = help_argv;
        argc = 3;
        sub = argv[1];
    }
    const int k = find_command(sub);
    if (k < 0) return unknown_command(sub);
    /* argv[0] of the subcommand is its full name: getopt's messages start with it. */
    char name[64];
    snprintf(name, sizeof name, "megatrain %s", sub);
    argv[1] = name;
    return commands[k].run(argc - 1, argv + 1);
}
