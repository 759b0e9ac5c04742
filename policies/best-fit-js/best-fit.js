// best-fit in JavaScript: the node left with the least free CPU and GPU
// after placing the task, both normalised by the largest node spec. The same
// float operations in the same order as policies/best-fit (Rust), so every
// score is bit-identical and replays agree placement for placement.

const DEFAULTS = { maxCpuMilli: 128000, maxGpuMilli: 8000 };
let maxCpu = DEFAULTS.maxCpuMilli;
let maxGpu = DEFAULTS.maxGpuMilli;

function number(doc, key, fallback) {
  if (!(key in doc)) return fallback;
  const v = doc[key];
  if (typeof v !== "number") throw `best-fit-js: bad configuration: ${key} is not a number`;
  return v;
}

export const policy = {
  info() {
    return { name: "best-fit-js", version: "1.0.0", hooks: { score: true, compact: false, rank: false, domains: false } };
  },

  configure(config) {
    if (config.trim() === "") return;
    let doc;
    try {
      doc = JSON.parse(config);
    } catch (e) {
      throw `best-fit-js: bad configuration: ${e}`;
    }
    if (doc === null || typeof doc !== "object" || Array.isArray(doc)) throw "best-fit-js: bad configuration: expected a JSON object";
    // A configuration replaces the previous one: absent keys take the defaults.
    const cpu = number(doc, "max_cpu_milli", DEFAULTS.maxCpuMilli);
    const gpu = number(doc, "max_gpu_milli", DEFAULTS.maxGpuMilli);
    maxCpu = cpu;
    maxGpu = gpu;
  },

  score(task, nodes) {
    const reqCpu = task.cpuMilli;
    const reqGpu = task.gpuCount * task.gpuMilli; // exact: both are u32 below 2^53 together
    const n = nodes.ids.length;
    const cpuFree = nodes.cpuFreeMilli, start = nodes.gpuStart, count = nodes.gpuCount, free = nodes.gpuFreeMilli;
    const scores = new Float64Array(n);
    for (let i = 0; i < n; i++) {
      let gpuFree = 0;
      for (let g = start[i], end = start[i] + count[i]; g < end; g++) gpuFree += free[g];
      const left = (cpuFree[i] - reqCpu) / maxCpu * 0.5 + (gpuFree - reqGpu) / maxGpu * 0.5;
      scores[i] = Math.trunc((1 - left) * 100); // keeps the sign of -0.x, as Rust's trunc
    }
    return { scores, gpus: new BigUint64Array(0) };
  },

  scoreDomains(task, domains) {
    throw "best-fit-js does not score domains";
  },

  compact(snapshot) {
    throw "best-fit-js does not compact";
  },

  rank(demand, victims) {
    throw "best-fit-js does not rank";
  },
};
