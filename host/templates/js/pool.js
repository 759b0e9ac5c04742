// {{name}}: a Berth model-pool policy (contract 0.3.0). poolPlace balances
// demand: models in order of demand (arrival rate x executor-seconds per
// request, highest first), each on the executor of its tensor-parallel
// degree with the least demand so far, unpinned (loaded when a step runs
// it). poolStep keeps tokens on time: a decoding batch about to be late
// decodes first, else the oldest waiting request's model is prefilled,
// else the batch with the least slack decodes.
//
// Column lists arrive as typed arrays (Uint32Array, Float64Array,
// BigUint64Array / BigInt64Array for 64-bit integers); u64 scalars as
// BigInt. Throw a string to return an error.

// Decode iterations per step (the host caps it; the default market at 64).
const ITERATIONS = 4;

export const policy = {
  info() {
    // The host calls only the hooks claimed here.
    return { name: "{{name}}", version: "0.1.0", hooks: { score: false, compact: false, rank: false, domains: false, poolPlace: true, poolStep: true } };
  },

  configure(config) {
    // TOML or JSON text from the operator; empty for defaults.
  },

  poolPlace(s) {
    const models = s.modelTp.length, executors = s.executorTp.length;
    const demand = Array.from({ length: models }, (_, m) => s.modelRate[m] * s.modelServiceS[m]);
    const order = Array.from({ length: models }, (_, m) => m).sort((a, b) => demand[b] - demand[a] || a - b);
    const load = new Array(executors).fill(0);
    const executor = [], model = [];
    for (const m of order) {
      let least = -1;
      for (let e = 0; e < executors; e++) if (s.executorTp[e] === s.modelTp[m] && (least < 0 || load[e] < load[least])) least = e;
      if (least < 0) continue; // no executor of its degree in this pool
      load[least] += demand[m];
      executor.push(least);
      model.push(m);
    }
    // The complete assignment, as pairs: executor, model, routing weight
    // >= 1, pinned 0/1.
    return {
      executor: Uint32Array.from(executor),
      model: Uint32Array.from(model),
      weight: new Uint32Array(model.length).fill(1),
      pinned: new Uint8Array(model.length),
    };
  },

  poolStep(x) {
    let urgent = -1, oldest = -1;
    for (let r = 0; r < x.model.length; r++) {
      if (x.decoding[r] > 0 && (urgent < 0 || x.decodeSlackMs[r] < x.decodeSlackMs[urgent])) urgent = r;
      if (x.waiting[r] > 0 && (oldest < 0 || x.oldestWaitMs[r] > x.oldestWaitMs[oldest])) oldest = r;
    }
    const none = new Uint32Array(0);
    if (urgent >= 0 && x.decodeSlackMs[urgent] < 2n * x.tbtTargetMs) return { phase: "decode", row: urgent, iterations: ITERATIONS, evict: none };
    if (oldest >= 0) return { phase: "prefill", row: oldest, iterations: 1, evict: none };
    if (urgent >= 0) return { phase: "decode", row: urgent, iterations: ITERATIONS, evict: none };
    return { phase: "idle", row: 0, iterations: 1, evict: none };
  },

  // Hooks not claimed in info(): never called.
  score(task, nodes) { throw "not implemented"; },
  scoreDomains(task, domains) { throw "not implemented"; },
  compact(snapshot) { throw "not implemented"; },
  rank(demand, victims) { throw "not implemented"; },
};
