/*
 * kinds.c - the table of what a specialization's graph computes (graphs.h,
 * enum spec_kind): every file that names, keys or tells kinds apart reads
 * it, so it sits below all of them.
 */
#include "graphs.h"

#include <string.h>

#pragma GCC poison request conn outmsg daemon

/* The checkpointed VJP is the scan op's whatever the strategy: no quick tier.
 * A VJP of blocks of steps needs AOTI's proxy executor (torch 2.14), which
 * the daemon cannot run: a grad's upgrade is unrolled or none.  The saved
 * pair is the unrolled loop's joint graph split in two (no quick tier). */
const struct spec_kind_info spec_kinds[SPEC_KINDS] = {
    /* name, job, grad, results, saved, tiered, blocks, budgeted */
    [SPEC_SCAN] = {"scan", "forward", false, true, false, true, true, true},
    [SPEC_GRAD] = {"grad", "vjp", true, true, false, true, false, true},
    [SPEC_GRAD_CHECKPOINT] = {"grad_checkpoint", "vjp_checkpoint", true, true, false, false, false,
                              true},
    [SPEC_SCAN_SAVE] = {"scan_save", "forward_save", false, true, true, false, false, true},
    [SPEC_GRAD_SAVED] = {"grad_saved", "backward_saved", true, false, true, false, false, false},
};

int spec_kind_parse(const char *s, size_t n)
{
	for (int k = 0; k < SPEC_KINDS; k++)
		if (strlen(spec_kinds[k].name) == n && memcmp(spec_kinds[k].name, s, n) == 0)
			return k;
	return -1;
}
