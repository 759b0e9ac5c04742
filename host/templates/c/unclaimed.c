// The hooks this policy does not claim: the component must still export
// them, and the host never calls them. build.sh defines BERTH_CLAIMS_<HOOK>
// for each hook the policy implements, which leaves its stub out; <HOOK> as
// in the hook flags BERTH_POLICY_TYPES_HOOKS_<HOOK>: SCORE, DOMAINS,
// COMPACT, RANK, POOL_PLACE, POOL_STEP.

#include "placement_policy.h"

static bool unclaimed(placement_policy_string_t *err) {
    placement_policy_string_dup(err, "not implemented");
    return false;
}

#ifndef BERTH_CLAIMS_SCORE
bool exports_berth_policy_policy_score(exports_berth_policy_policy_task_t *task, exports_berth_policy_policy_nodes_t *nodes,
                                       exports_berth_policy_policy_scores_t *ret, placement_policy_string_t *err) {
    (void)ret;
    exports_berth_policy_policy_task_free(task);
    exports_berth_policy_policy_nodes_free(nodes);
    return unclaimed(err);
}
#endif

#ifndef BERTH_CLAIMS_DOMAINS
bool exports_berth_policy_policy_score_domains(exports_berth_policy_policy_task_t *task, exports_berth_policy_policy_domains_t *domains,
                                               placement_policy_list_f64_t *ret, placement_policy_string_t *err) {
    (void)ret;
    exports_berth_policy_policy_task_free(task);
    exports_berth_policy_policy_domains_free(domains);
    return unclaimed(err);
}
#endif

#ifndef BERTH_CLAIMS_COMPACT
bool exports_berth_policy_policy_compact(exports_berth_policy_policy_snapshot_t *snapshot, exports_berth_policy_policy_plan_t *ret,
                                         placement_policy_string_t *err) {
    (void)ret;
    exports_berth_policy_policy_snapshot_free(snapshot);
    return unclaimed(err);
}
#endif

#ifndef BERTH_CLAIMS_RANK
bool exports_berth_policy_policy_rank(exports_berth_policy_policy_task_t *demand, exports_berth_policy_policy_allocations_t *victims,
                                      placement_policy_list_u32_t *ret, placement_policy_string_t *err) {
    (void)ret;
    exports_berth_policy_policy_task_free(demand);
    exports_berth_policy_policy_allocations_free(victims);
    return unclaimed(err);
}
#endif

#ifndef BERTH_CLAIMS_POOL_PLACE
bool exports_berth_policy_policy_pool_place(exports_berth_policy_policy_pool_state_t *state,
                                            exports_berth_policy_policy_pool_placement_t *ret, placement_policy_string_t *err) {
    (void)ret;
    exports_berth_policy_policy_pool_state_free(state);
    return unclaimed(err);
}
#endif

#ifndef BERTH_CLAIMS_POOL_STEP
bool exports_berth_policy_policy_pool_step(exports_berth_policy_policy_pool_executor_t *executor,
                                           exports_berth_policy_policy_pool_choice_t *ret, placement_policy_string_t *err) {
    (void)ret;
    exports_berth_policy_policy_pool_executor_free(executor);
    return unclaimed(err);
}
#endif
