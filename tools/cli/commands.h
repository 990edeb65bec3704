/* The subcommands of the megatrain command: each takes its argv (argv[0] its own name, as
 * "megatrain train") and returns the exit status: 0, 1 when the run failed, 2 for a usage error. */
#ifndef MT_TOOLS_CLI_COMMANDS_H
#define MT_TOOLS_CLI_COMMANDS_H

int cli_train(int argc, char **argv);
int cli_prepare(int argc, char **argv);
int cli_plan(int argc, char **argv);
int cli_bench(int argc, char **argv);
int cli_grads(int argc, char **argv);
int cli_info(int argc, char **argv);
int cli_plot(int argc, char **argv);
int cli_eval(int argc, char **argv);
int cli_generate(int argc, char **argv);

#endif
