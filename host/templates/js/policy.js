// {{name}}: a Berth placement policy. Scores each candidate node for one
// task; the host places on the highest score. This one packs: the node left
// with the least free GPU after placing the task wins.
//
// Column lists arrive as typed arrays (Uint32Array, BigUint64Array); u64
// scalars as BigInt. Throw a string to return an error.

export const policy = {
  info() {
    // The host calls only the hooks claimed here.
    return { name: "{{name}}", version: "0.1.0", hooks: { score: true, compact: false, rank: false, domains: false, poolPlace: false, poolStep: false } };
  },

  configure(config) {
    // TOML or JSON text from the operator; empty for defaults.
  },

  score(task, nodes) {
    const wanted = task.gpuCount * task.gpuMilli;
    const n = nodes.ids.length;
    const scores = new Float64Array(n);
    for (let i = 0; i < n; i++) {
      let free = 0;
      for (let g = nodes.gpuStart[i]; g < nodes.gpuStart[i] + nodes.gpuCount[i]; g++) free += nodes.gpuFreeMilli[g];
      scores[i] = -(free - wanted);
    }
    // One finite score per node, in batch order; no GPU masks: the host
    // chooses the GPUs on the winning node.
    return { scores, gpus: new BigUint64Array(0) };
  },

  // Optional hooks. The host calls only those claimed in info() (set the
  // flag to true); `berth policy test` then checks the claimed ones too.
  scoreDomains(task, domains) { throw "not implemented"; },
  compact(snapshot) { throw "not implemented"; },
  rank(demand, victims) { throw "not implemented"; },

  // Contract 0.3.0, model pools (`berth replay --pool`). Unclaimed, the
  // host's defaults apply: every model on every executor of its
  // tensor-parallel degree, unpinned; each step prefills the row whose
  // oldest request waited longest, else decodes the row with least slack.
  poolPlace(state) {
    // Return the complete assignment, as pairs:
    // { executor: Uint32Array, model: Uint32Array, weight: Uint32Array (>= 1), pinned: Uint8Array (0/1) }
    throw "not implemented";
  },
  poolStep(executor) {
    // Return e.g. { phase: "prefill", row, iterations: 1, evict: new Uint32Array(0) }.
    throw "not implemented";
  },
};
