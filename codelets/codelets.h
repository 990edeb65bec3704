/* Every codelet of a training step, for callers that submit several families: what each task
 * reads and writes (buffer order and access modes) and the arguments it takes are in the
 * family's header. */
#ifndef MT_CODELETS_CODELETS_H
#define MT_CODELETS_CODELETS_H

#include "codelets/adamw.h"
#include "codelets/adamw_compact.h"
#include "codelets/clip.h"
#include "codelets/common.h"
#include "codelets/embedding.h"
#include "codelets/fill.h"
#include "codelets/grad_home.h"
#include "codelets/head.h"
#include "codelets/layer.h"

#endif
