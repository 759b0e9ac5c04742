// {{name}}: a Berth preemption-ranking policy. When high-priority work
// needs room, the host offers the running allocations it may evict and
// evicts in the order returned until the work fits. This one evicts the
// work with the least to recompute first (SpotGPU): GPUs held x seconds
// since the last checkpoint, summed over a job's allocations; lower
// priority always goes first, the job id breaks ties.
//
// Column lists arrive as typed arrays (Uint32Array, BigUint64Array for
// u64); throw a string to return an error.

export const policy = {
  info() {
    // The host calls only the hooks claimed here.
    return { name: "{{name}}", version: "0.1.0", hooks: { score: false, compact: false, rank: true, domains: false, poolPlace: false, poolStep: false } };
  },

  configure(config) {
    // TOML or JSON text from the operator; empty for defaults.
  },

  rank(demand, victims) {
    // A job (a gang) is evicted whole: group its allocations, in order of
    // first appearance.
    const jobs = new Map();
    for (let i = 0; i < victims.ids.length; i++) {
      let count = 0;
      for (let mask = victims.gpus[i]; mask > 0n; mask >>= 1n) count += Number(mask & 1n);
      const gpus = (count * victims.gpuMilli[i]) / 1000;
      const id = victims.jobIds[i];
      if (!jobs.has(id)) jobs.set(id, { id, priority: victims.priority[i], lost: 0, members: [] });
      const job = jobs.get(id);
      job.lost += gpus * Number(victims.sinceCheckpointS[i]);
      job.members.push(i);
    }
    const order = [...jobs.values()].sort((a, b) => a.priority - b.priority || a.lost - b.lost || (a.id < b.id ? -1 : a.id > b.id ? 1 : 0));
    // Every index of the victim list, each once.
    return Uint32Array.from(order.flatMap((job) => job.members));
  },

  // Hooks not claimed in info(): never called.
  score(task, nodes) { throw "not implemented"; },
  scoreDomains(task, domains) { throw "not implemented"; },
  compact(snapshot) { throw "not implemented"; },
  poolPlace(state) { throw "not implemented"; },
  poolStep(executor) { throw "not implemented"; },
};
