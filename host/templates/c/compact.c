// {{name}}: a Berth compaction policy. Plans moves that free whole nodes,
// one move per allocation: the emptiest nodes whose allocations may all
// move (movable, not in a gang) go first, and each allocation goes to the
// busy node of the same GPU model left with the least free GPU that has
// room. A node whose allocations cannot all move is left alone. The host
// checks the plan and runs each chain make-before-break.
//
// Bindings come from `wit-bindgen c` (build.sh). Arguments are owned by the
// callee: free them. Returned lists must be malloc'd: the generated
// post-return code frees them once the host has copied them.

#include <stdlib.h>
#include <string.h>

#include "placement_policy.h"

void exports_berth_policy_policy_info(exports_berth_policy_policy_policy_info_t *ret) {
    placement_policy_string_dup(&ret->name, "{{name}}");
    placement_policy_string_dup(&ret->version, "0.1.0");
    // The host calls only the hooks claimed here (build.sh leaves their
    // stubs out of unclaimed.c).
    ret->hooks = BERTH_POLICY_TYPES_HOOKS_COMPACT;
}

bool exports_berth_policy_policy_configure(placement_policy_string_t *config, placement_policy_string_t *err) {
    // TOML or JSON text from the operator; empty for defaults.
    (void)err;
    placement_policy_string_free(config);
    return true;
}

static void *alloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size);
    if (p == NULL) abort();
    return p;
}

// The GPU mask an allocation of `count` GPUs at `milli` each takes among
// `free` (free thousandths of `gpus` GPUs): whole GPUs lowest index first, a
// shared GPU the fullest that fits. Returns false if it does not fit.
static bool fit_gpus(const uint32_t *free, uint32_t gpus, uint32_t count, uint32_t milli, uint64_t *mask) {
    *mask = 0;
    if (count == 0) return true;
    if (milli < 1000) {
        int best = -1;
        for (uint32_t g = 0; g < gpus; g++)
            if (free[g] >= milli && (best < 0 || free[g] < free[best])) best = (int)g;
        if (best < 0) return false;
        *mask = 1ull << best;
        return true;
    }
    uint32_t got = 0;
    for (uint32_t g = 0; g < gpus && got < count; g++)
        if (free[g] >= milli) *mask |= 1ull << g, got++;
    return got == count;
}

// Takes (sign -1) or gives back (+1) allocation i's room on node k.
static void take(exports_berth_policy_policy_snapshot_t *s, uint32_t *free, uint32_t *cpu, uint64_t *mem, size_t k, size_t i, uint64_t mask,
                 int sign) {
    berth_policy_types_allocations_t *a = &s->allocations;
    cpu[k] += (uint32_t)sign * a->cpu_milli.ptr[i];
    mem[k] += (uint64_t)(int64_t)sign * a->memory_mib.ptr[i];
    for (uint32_t g = 0; g < s->nodes.gpu_count.ptr[k]; g++)
        if (mask >> g & 1) free[s->nodes.gpu_start.ptr[k] + g] += (uint32_t)sign * a->gpu_milli.ptr[i];
}

bool exports_berth_policy_policy_compact(exports_berth_policy_policy_snapshot_t *s, exports_berth_policy_policy_plan_t *ret,
                                         placement_policy_string_t *err) {
    (void)err;
    berth_policy_types_nodes_t *n = &s->nodes;
    berth_policy_types_allocations_t *a = &s->allocations;
    size_t nodes = n->ids.len, allocs = a->ids.len;
    uint32_t *gpu_free = alloc(n->gpu_free_milli.len, sizeof(uint32_t)), *cpu = alloc(nodes, sizeof(uint32_t));
    uint64_t *mem = alloc(nodes, sizeof(uint64_t));
    memcpy(gpu_free, n->gpu_free_milli.ptr, n->gpu_free_milli.len * sizeof(uint32_t));
    memcpy(cpu, n->cpu_free_milli.ptr, nodes * sizeof(uint32_t));
    memcpy(mem, n->memory_free_mib.ptr, nodes * sizeof(uint64_t));
    // The node of each allocation (its position in the batch), and how
    // many allocations each node holds now.
    long *node_of = alloc(allocs, sizeof(long));
    size_t *held = alloc(nodes, sizeof(size_t)), *candidates = alloc(nodes, sizeof(size_t)), *residents = alloc(allocs, sizeof(size_t));
    bool *emptied = alloc(nodes, sizeof(bool)), *received = alloc(nodes, sizeof(bool)), *blocked = alloc(nodes, sizeof(bool));
    uint64_t *used = alloc(nodes, sizeof(uint64_t));
    size_t *move_node = alloc(allocs, sizeof(size_t));
    uint64_t *move_mask = alloc(allocs, sizeof(uint64_t));
    uint32_t *chain = alloc(allocs, sizeof(uint32_t)), *allocation = alloc(allocs, sizeof(uint32_t)), *dest = alloc(allocs, sizeof(uint32_t));
    uint64_t *dest_gpus = alloc(allocs, sizeof(uint64_t));
    for (size_t i = 0; i < allocs; i++) {
        node_of[i] = -1;
        for (size_t k = 0; k < nodes && node_of[i] < 0; k++)
            if (n->ids.ptr[k] == a->node.ptr[i]) node_of[i] = (long)k;
        if (node_of[i] < 0) continue;
        held[node_of[i]]++;
        if (a->movable.ptr[i] != 1 || a->gang_id.ptr[i] != 0) blocked[node_of[i]] = true;
    }
    // Candidates, emptiest first: least GPU allocated, fewest allocations.
    size_t count = 0;
    for (size_t k = 0; k < nodes; k++) {
        if (held[k] == 0 || blocked[k]) continue;
        for (uint32_t g = 0; g < n->gpu_count.ptr[k]; g++) {
            uint32_t f = gpu_free[n->gpu_start.ptr[k] + g];
            used[k] += 1000 - (f < 1000 ? f : 1000);
        }
        size_t j = count++;
        while (j > 0 && (used[candidates[j - 1]] > used[k] || (used[candidates[j - 1]] == used[k] && held[candidates[j - 1]] > held[k]))) {
            candidates[j] = candidates[j - 1];
            j--;
        }
        candidates[j] = k;
    }
    size_t moves_out = 0;
    uint32_t chains = 0;
    for (size_t c = 0; c < count; c++) {
        size_t t = candidates[c];
        if (received[t]) continue;
        // Its allocations, largest first (GPUs x thousandths, then CPU).
        size_t r = 0;
        for (size_t i = 0; i < allocs; i++) {
            if (node_of[i] != (long)t) continue;
            uint64_t size = (uint64_t)__builtin_popcountll(a->gpus.ptr[i]) * a->gpu_milli.ptr[i];
            size_t j = r++;
            while (j > 0) {
                size_t p = residents[j - 1];
                uint64_t psize = (uint64_t)__builtin_popcountll(a->gpus.ptr[p]) * a->gpu_milli.ptr[p];
                if (psize > size || (psize == size && a->cpu_milli.ptr[p] >= a->cpu_milli.ptr[i])) break;
                residents[j] = p;
                j--;
            }
            residents[j] = i;
        }
        size_t moved = 0;
        for (; moved < r; moved++) {
            size_t i = residents[moved];
            uint32_t want = (uint32_t)__builtin_popcountll(a->gpus.ptr[i]);
            long best = -1;
            uint64_t best_left = 0, best_mask = 0;
            for (size_t k = 0; k < nodes; k++) {
                if (k == t || emptied[k] || held[k] == 0 || (want > 0 && n->model.ptr[k] != n->model.ptr[t])) continue;
                if (cpu[k] < a->cpu_milli.ptr[i] || mem[k] < a->memory_mib.ptr[i]) continue;
                uint64_t mask, left = 0;
                if (!fit_gpus(gpu_free + n->gpu_start.ptr[k], n->gpu_count.ptr[k], want, a->gpu_milli.ptr[i], &mask)) continue;
                for (uint32_t g = 0; g < n->gpu_count.ptr[k]; g++) left += gpu_free[n->gpu_start.ptr[k] + g];
                if (best < 0 || left < best_left) best = (long)k, best_left = left, best_mask = mask;
            }
            if (best < 0) break;
            take(s, gpu_free, cpu, mem, (size_t)best, i, best_mask, -1);
            held[best]++;
            move_node[moved] = (size_t)best;
            move_mask[moved] = best_mask;
        }
        if (moved < r) {
            // Not every allocation found room: give back what was taken.
            while (moved-- > 0) {
                take(s, gpu_free, cpu, mem, move_node[moved], residents[moved], move_mask[moved], +1);
                held[move_node[moved]]--;
            }
            continue;
        }
        for (size_t m = 0; m < r; m++) {
            received[move_node[m]] = true;
            chain[moves_out] = chains;
            allocation[moves_out] = a->ids.ptr[residents[m]];
            dest[moves_out] = n->ids.ptr[move_node[m]];
            dest_gpus[moves_out] = move_mask[m];
            node_of[residents[m]] = (long)move_node[m];
            moves_out++;
        }
        held[t] = 0;
        emptied[t] = true;
        chains++;
    }
    ret->chain = (placement_policy_list_u32_t){chain, moves_out};
    ret->allocation = (placement_policy_list_u32_t){allocation, moves_out};
    ret->dest_node = (placement_policy_list_u32_t){dest, moves_out};
    ret->dest_gpus = (placement_policy_list_u64_t){dest_gpus, moves_out};
    free(gpu_free), free(cpu), free(mem), free(node_of), free(held), free(candidates), free(residents);
    free(emptied), free(received), free(blocked), free(used), free(move_node), free(move_mask);
    exports_berth_policy_policy_snapshot_free(s);
    return true;
}
