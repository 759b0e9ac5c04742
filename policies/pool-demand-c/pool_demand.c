// pool-demand-c: a demand-balanced model pool, the rule of
// policies/pool-demand (Rust) in C, deciding as it does.
// Placement: models in order of demand (recent arrival rate x
// executor-seconds per request, highest first, then model id), each on the
// executor of its tensor-parallel degree with the least demand so far (then
// executor id), unpinned (loaded when a step runs it). Steps: a decoding
// batch about to be late (slack under two time-between-tokens targets)
// decodes first, the most urgent one; otherwise the row whose oldest
// request waited longest is prefilled; otherwise the row with the least
// slack decodes. Decodes run four iterations.
//
// Bindings come from `wit-bindgen c` (build.sh). Arguments are owned by the
// callee: free them. Returned lists must be malloc'd: the generated
// post-return code frees them once the host has copied them.

#include <stdlib.h>

#include "placement_policy.h"

#define ITERATIONS 4

static void *alloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size);
    if (p == NULL) abort();
    return p;
}

void exports_berth_policy_policy_info(exports_berth_policy_policy_policy_info_t *ret) {
    placement_policy_string_dup(&ret->name, "pool-demand-c");
    placement_policy_string_dup(&ret->version, "1.0.0");
    // The host calls only the hooks claimed here.
    ret->hooks = BERTH_POLICY_TYPES_HOOKS_POOL_PLACE | BERTH_POLICY_TYPES_HOOKS_POOL_STEP;
}

bool exports_berth_policy_policy_configure(placement_policy_string_t *config, placement_policy_string_t *err) {
    // Nothing to configure; any text is accepted.
    (void)err;
    placement_policy_string_free(config);
    return true;
}

bool exports_berth_policy_policy_pool_place(exports_berth_policy_policy_pool_state_t *s,
                                            exports_berth_policy_policy_pool_placement_t *ret, placement_policy_string_t *err) {
    (void)err;
    size_t models = s->model_tp.len, execs = s->executor_tp.len;
    double *demand = alloc(models, sizeof(double)), *load = alloc(execs, sizeof(double));
    size_t *order = alloc(models, sizeof(size_t));
    for (size_t m = 0; m < models; m++) {
        demand[m] = s->model_rate.ptr[m] * s->model_service_s.ptr[m];
        // Insertion sort: highest demand first, then model id.
        size_t j = m;
        while (j > 0 && demand[order[j - 1]] < demand[m]) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = m;
    }
    uint32_t *executor = alloc(models, sizeof(uint32_t)), *model = alloc(models, sizeof(uint32_t)), *weight = alloc(models, sizeof(uint32_t));
    uint8_t *pinned = alloc(models, sizeof(uint8_t));
    size_t pairs = 0;
    for (size_t k = 0; k < models; k++) {
        size_t m = order[k];
        long least = -1;
        for (size_t e = 0; e < execs; e++) {
            if (s->executor_tp.ptr[e] == s->model_tp.ptr[m] && (least < 0 || load[e] < load[least])) least = (long)e;
        }
        if (least < 0) continue;
        load[least] += demand[m];
        executor[pairs] = (uint32_t)least;
        model[pairs] = (uint32_t)m;
        weight[pairs] = 1;
        pinned[pairs] = 0;
        pairs++;
    }
    ret->executor = (placement_policy_list_u32_t){executor, pairs};
    ret->model = (placement_policy_list_u32_t){model, pairs};
    ret->weight = (placement_policy_list_u32_t){weight, pairs};
    ret->pinned = (placement_policy_list_u8_t){pinned, pairs};
    free(demand);
    free(load);
    free(order);
    exports_berth_policy_policy_pool_state_free(s);
    return true;
}

bool exports_berth_policy_policy_pool_step(exports_berth_policy_policy_pool_executor_t *x,
                                           exports_berth_policy_policy_pool_choice_t *ret, placement_policy_string_t *err) {
    (void)err;
    size_t rows = x->model.len;
    long urgent = -1, oldest = -1;
    for (size_t r = 0; r < rows; r++) {
        if (x->decoding.ptr[r] > 0 && (urgent < 0 || x->decode_slack_ms.ptr[r] < x->decode_slack_ms.ptr[urgent])) urgent = (long)r;
        if (x->waiting.ptr[r] > 0 && (oldest < 0 || x->oldest_wait_ms.ptr[r] > x->oldest_wait_ms.ptr[oldest])) oldest = (long)r;
    }
    ret->phase = BERTH_POLICY_TYPES_POOL_PHASE_IDLE;
    ret->row = 0;
    ret->iterations = 0;
    ret->evict = (placement_policy_list_u32_t){NULL, 0};
    if (urgent >= 0 && x->decode_slack_ms.ptr[urgent] < 2 * (int64_t)x->tbt_target_ms) {
        ret->phase = BERTH_POLICY_TYPES_POOL_PHASE_DECODE;
        ret->row = (uint32_t)urgent;
        ret->iterations = ITERATIONS;
    } else if (oldest >= 0) {
        ret->phase = BERTH_POLICY_TYPES_POOL_PHASE_PREFILL;
        ret->row = (uint32_t)oldest;
    } else if (urgent >= 0) {
        ret->phase = BERTH_POLICY_TYPES_POOL_PHASE_DECODE;
        ret->row = (uint32_t)urgent;
        ret->iterations = ITERATIONS;
    }
    exports_berth_policy_policy_pool_executor_free(x);
    return true;
}
