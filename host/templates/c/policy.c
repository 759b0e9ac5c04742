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
    // The host calls only the hooks claimed here.
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

// Optional hooks. The host calls only those claimed in info(), e.g.
// BERTH_POLICY_TYPES_HOOKS_SCORE | BERTH_POLICY_TYPES_HOOKS_POOL_PLACE;
// `berth policy test` then checks the claimed ones too.
static bool unclaimed(placement_policy_string_t *err) {
    placement_policy_string_dup(err, "not implemented");
    return false;
}

bool exports_berth_policy_policy_score_domains(exports_berth_policy_policy_task_t *task, exports_berth_policy_policy_domains_t *domains,
                                               placement_policy_list_f64_t *ret, placement_policy_string_t *err) {
    (void)ret;
    exports_berth_policy_policy_task_free(task);
    exports_berth_policy_policy_domains_free(domains);
    return unclaimed(err);
}

bool exports_berth_policy_policy_compact(exports_berth_policy_policy_snapshot_t *snapshot, exports_berth_policy_policy_plan_t *ret,
                                         placement_policy_string_t *err) {
    (void)ret;
    exports_berth_policy_policy_snapshot_free(snapshot);
    return unclaimed(err);
}

bool exports_berth_policy_policy_rank(exports_berth_policy_policy_task_t *demand, exports_berth_policy_policy_allocations_t *victims,
                                      placement_policy_list_u32_t *ret, placement_policy_string_t *err) {
    (void)ret;
    exports_berth_policy_policy_task_free(demand);
    exports_berth_policy_policy_allocations_free(victims);
    return unclaimed(err);
}

// Contract 0.3.0, model pools (`berth replay --pool`). Unclaimed, the host's
// defaults apply: every model on every executor of its tensor-parallel
// degree, unpinned; each step prefills the row whose oldest request waited
// longest, else decodes the row with least slack.
bool exports_berth_policy_policy_pool_place(exports_berth_policy_policy_pool_state_t *state,
                                            exports_berth_policy_policy_pool_placement_t *ret, placement_policy_string_t *err) {
    // Fill ret with the complete assignment, as pairs (executor, model,
    // weight >= 1, pinned 0/1), each column malloc'd.
    (void)ret;
    exports_berth_policy_policy_pool_state_free(state);
    return unclaimed(err);
}

bool exports_berth_policy_policy_pool_step(exports_berth_policy_policy_pool_executor_t *executor,
                                           exports_berth_policy_policy_pool_choice_t *ret, placement_policy_string_t *err) {
    // E.g. ret->phase = BERTH_POLICY_TYPES_POOL_PHASE_PREFILL; ret->row = r;
    // ret->iterations = 1; ret->evict.len = 0 to prefill row r.
    (void)ret;
    exports_berth_policy_policy_pool_executor_free(executor);
    return unclaimed(err);
}
