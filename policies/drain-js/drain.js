// drain-js: frees whole nodes, one move per allocation: the rule of
// policies/drain (Rust), in JavaScript, deciding move for move as it does.
// Candidates are nodes whose allocations are all movable and none in a
// gang, emptiest first (least GPU allocated, then fewest allocations, then
// batch order). Each candidate's allocations, largest first, go to the
// best-fitting other node: the same GPU model for GPU work, already busy,
// not emptied by this plan, with room for CPU, memory and GPUs (whole GPUs
// lowest index first, a shared GPU the fullest that fits); best is the node
// left with the least free GPU, then batch order. A candidate whose
// allocations all find room becomes one chain; otherwise nothing of it
// moves. A node that took a moved allocation is never emptied after.
//
// Column lists arrive as typed arrays (Uint32Array, BigUint64Array for
// u64); throw a string to return an error.

// GPU indexes set in a mask (bit g = GPU g).
function gpusOf(mask) {
  const out = [];
  for (let g = 0; mask > 0n; g++, mask >>= 1n) if (mask & 1n) out.push(g);
  return out;
}

// The GPUs an allocation of `count` GPUs at `milli` each takes among
// `free` (free thousandths per GPU), as indexes, or null if it does not fit.
function fitGpus(free, count, milli) {
  if (count === 0) return [];
  if (milli < 1000) {
    let best = -1;
    for (let g = 0; g < free.length; g++) if (free[g] >= milli && (best < 0 || free[g] < free[best])) best = g;
    return best < 0 ? null : [best];
  }
  const chosen = [];
  for (let g = 0; g < free.length && chosen.length < count; g++) if (free[g] >= milli) chosen.push(g);
  return chosen.length === count ? chosen : null;
}

function plan(snapshot) {
  const n = snapshot.nodes, a = snapshot.allocations;
  const nodes = n.ids.length, allocs = a.ids.length;
  const free = [], cpu = [], mem = [], on = [];
  for (let k = 0; k < nodes; k++) {
    free.push(Array.from(n.gpuFreeMilli.subarray(n.gpuStart[k], n.gpuStart[k] + n.gpuCount[k])));
    cpu.push(n.cpuFreeMilli[k]);
    mem.push(Number(n.memoryFreeMib[k]));
    on.push([]);
  }
  const position = new Map();
  for (let k = nodes - 1; k >= 0; k--) position.set(n.ids[k], k);
  const gpus = [];
  for (let i = 0; i < allocs; i++) {
    gpus.push(gpusOf(a.gpus[i]));
    const k = position.get(a.node[i]);
    if (k !== undefined) on[k].push(i);
  }
  const size = (i) => gpus[i].length * a.gpuMilli[i];
  const used = (k) => free[k].reduce((s, f) => s + 1000 - Math.min(f, 1000), 0);
  const candidates = [];
  for (let k = 0; k < nodes; k++) {
    if (on[k].length > 0 && on[k].every((i) => a.movable[i] === 1 && a.gangId[i] === 0n)) candidates.push(k);
  }
  const usedAtStart = candidates.map(used);
  const order = candidates.map((k, j) => [usedAtStart[j], on[k].length, k]);
  order.sort((x, y) => x[0] - y[0] || x[1] - y[1] || x[2] - y[2]);
  const emptied = new Array(nodes).fill(false), received = new Array(nodes).fill(false);
  const out = { chain: [], allocation: [], destNode: [], destGpus: [] };
  let chain = 0;
  for (const [, , t] of order) {
    if (received[t]) continue;
    const residents = on[t].slice().sort((i, j) => size(j) - size(i) || a.cpuMilli[j] - a.cpuMilli[i] || i - j);
    const moves = [];
    for (const i of residents) {
      const count = gpus[i].length;
      let best = null;
      for (let k = 0; k < nodes; k++) {
        if (k === t || emptied[k] || on[k].length === 0 || (count > 0 && n.model[k] !== n.model[t])) continue;
        if (cpu[k] < a.cpuMilli[i] || mem[k] < Number(a.memoryMib[i])) continue;
        const fit = fitGpus(free[k], count, a.gpuMilli[i]);
        if (fit === null) continue;
        const left = free[k].reduce((s, f) => s + f, 0);
        if (best === null || left < best.left) best = { left, k, fit };
      }
      if (best === null) break;
      cpu[best.k] -= a.cpuMilli[i];
      mem[best.k] -= Number(a.memoryMib[i]);
      for (const g of best.fit) free[best.k][g] -= a.gpuMilli[i];
      on[best.k].push(i);
      moves.push([i, best.k, best.fit]);
    }
    if (moves.length < residents.length) {
      for (const [i, k, fit] of moves.reverse()) {
        cpu[k] += a.cpuMilli[i];
        mem[k] += Number(a.memoryMib[i]);
        for (const g of fit) free[k][g] += a.gpuMilli[i];
        on[k].pop();
      }
      continue;
    }
    for (const [i, k, fit] of moves) {
      received[k] = true;
      out.chain.push(chain);
      out.allocation.push(a.ids[i]);
      out.destNode.push(n.ids[k]);
      out.destGpus.push(fit.reduce((m, g) => m | (1n << BigInt(g)), 0n));
    }
    on[t] = [];
    emptied[t] = true;
    chain++;
  }
  return {
    chain: Uint32Array.from(out.chain),
    allocation: Uint32Array.from(out.allocation),
    destNode: Uint32Array.from(out.destNode),
    destGpus: BigUint64Array.from(out.destGpus),
  };
}

export const policy = {
  info() {
    // The host calls only the hooks claimed here.
    return { name: "drain-js", version: "1.0.0", hooks: { score: false, compact: true, rank: false, domains: false, poolPlace: false, poolStep: false } };
  },
  configure(config) {},
  compact(snapshot) {
    return plan(snapshot);
  },
  // Hooks not claimed in info(): never called.
  score(task, nodes) { throw "not implemented"; },
  scoreDomains(task, domains) { throw "not implemented"; },
  rank(demand, victims) { throw "not implemented"; },
  poolPlace(state) { throw "not implemented"; },
  poolStep(executor) { throw "not implemented"; },
};
