/* libFuzzer harness: a config.json (mt_config_parse, models/config/json.c). A config the parser accepts
 * must be one its sizes can be computed for (parameter counts, tile layouts) and must survive
 * mt_config_save and a second parse unchanged. The dictionary (config.dict) holds the keys and
 * values near the integer limits. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/config.h"
#include "models/layout.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    memcpy(text, data, size);
    text[size] = 0;
    mt_model_config cfg;
    char err[1024];
    int rc = mt_config_parse(text, "config.json", &cfg, err, sizeof err);
    free(text);
    if (rc) {
        FUZZ_CHECK(strstr(err, "config.json") != NULL, "message without the name: %s", err);
        return 0;
    }
    FUZZ_CHECK(mt_config_validate(&cfg, "config.json", err, sizeof err) == 0, "parsed but invalid: %s", err);
    int64_t n = mt_config_param_count(&cfg), nf = mt_config_flops_params(&cfg);
    FUZZ_CHECK(n > 0 && nf > 0, "parameter counts %lld, %lld", (long long)n, (long long)nf);
    mt_tile_layout l[3];
    for (int k = 0; k < 3; k++) {
        mt_layout_build(&cfg, (mt_tile_kind)k, &l[k]);
        FUZZ_CHECK(l[k].numel >= 0, "tile kind %d: %lld elements", k, (long long)l[k].numel);
        for (int s = 0; s < l[k].ntensors; s++)
            FUZZ_CHECK(l[k].tensors[s].offset + l[k].tensors[s].numel <= l[k].numel, "tile kind %d tensor %d past the tile",
                       k, s);
    }
    char path[8192];
    snprintf(path, sizeof path, "%s/config.json", fuzz_dir());
    FUZZ_CHECK(mt_config_save(&cfg, path, err, sizeof err) == 0, "save: %s", err);
    mt_model_config again;
    FUZZ_CHECK(mt_config_load(path, &again, err, sizeof err) == 0, "the saved config does not load: %s", err);
    FUZZ_CHECK(memcmp(&cfg, &again, sizeof cfg) == 0, "the saved config loads as another one");
    return 0;
}
