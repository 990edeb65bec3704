/* A host state without StarPU for the checkpoint and HF-directory harnesses: the tiles of a tiny
 * Qwen2-style model (mt_layout_build's layout, plain malloc'd master and AdamW buffers, no
 * handles), and an mt_state_sync_weights that has no streamed copy to refresh. */
#ifndef MT_TESTS_FUZZ_FAKE_STATE_H
#define MT_TESTS_FUZZ_FAKE_STATE_H

#include "runtime/state.h"

/* The tiny model's config.json text. */
extern const char fuzz_tiny_config[];

/* The state of fuzz_tiny_config with master weights 0.001 * index; aborts on a bad config. */
mt_host_state *fuzz_fake_state(void);

#endif
