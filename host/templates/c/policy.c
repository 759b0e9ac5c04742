// {{name}}: a Berth placement policy. Scores each candidate node for one
// task; the host places on the highest score. This one packs: the node left
// with the least free GPU after placing the task wins.
//
// Bindings come from `wit-bindgen c` (build.sh). Arguments are owned by the
// callee: free them. Returned lists and strings must be malloc'd: the
// generated post-return code frees them once the host has copied them.

#include <stdlib.h>
#include <string.h>

#include "placement_policy.h"

void exports_berth_policy_policy_info(exports_berth_policy_policy_policy_info_t *ret) {
    placement_policy_string_dup(&ret->name, "{{name}}");
    placement_policy_string_dup(&ret->version, "0.1.0");
    // The host calls only the hooks claimed here (build.sh leaves their
    // stubs out of unclaimed.c).
    ret->hooks = BERTH_POLICY_TYPES_HOOKS_SCORE;
}

bool exports_berth_policy_policy_configure(placement_policy_string_t *config, placement_policy_string_t *err) {
    // TOML or JSON text from the operator; empty for defaults. To reject it,
    // set *err (placement_policy_string_dup) and return false.
    (void)err;
    placement_policy_string_free(config);
    return true;
}

bool exports_berth_policy_policy_score(exports_berth_policy_policy_task_t *task, exports_berth_policy_policy_nodes_t *nodes,
                                       exports_berth_policy_policy_scores_t *ret, placement_policy_string_t *err) {
    (void)err;
    size_t n = nodes->ids.len;
    double *scores = malloc((n ? n : 1) * sizeof(double));
    if (scores == NULL) abort();
    double wanted = (double)task->gpu_count * (double)task->gpu_milli;
    for (size_t i = 0; i < n; i++) {
        uint32_t start = nodes->gpu_start.ptr[i], count = nodes->gpu_count.ptr[i];
        double free_milli = 0;
        for (uint32_t g = start; g < start + count; g++) free_milli += nodes->gpu_free_milli.ptr[g];
        scores[i] = -(free_milli - wanted);
    }
    // One finite score per node, in batch order; no GPU masks: the host
    // chooses the GPUs on the winning node.
    ret->scores.ptr = scores;
    ret->scores.len = n;
    ret->gpus.ptr = NULL;
    ret->gpus.len = 0;
    exports_berth_policy_policy_task_free(task);
    exports_berth_policy_policy_nodes_free(nodes);
    return true;
}

// The other hooks are in unclaimed.c: to claim one, add its flag above,
// implement it here, and add -DBERTH_CLAIMS_<HOOK> to build.sh's claims.
