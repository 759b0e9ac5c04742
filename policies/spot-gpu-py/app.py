"""spot-gpu-py: SpotGPU's preemption order in Python. Evicts the work with
the least to recompute first: GPUs held x seconds since the last
checkpoint, summed over a job's allocations; lower priority always goes
first and the job id breaks ties. The same float operations in the same
order as policies/spot-gpu (Rust), so both rank every victim list of
preemptible work alike; built on contract 0.2.0, it does not see tiers
(spot-gpu 1.1.0 takes opportunistic work first)."""

from wit_world import exports
from wit_world.imports import types
from componentize_py_types import Err


class Policy(exports.Policy):
    def info(self) -> types.PolicyInfo:
        # The host calls only the hooks claimed here.
        return types.PolicyInfo(name="spot-gpu-py", version="1.0.0", hooks=types.Hooks.RANK)

    def configure(self, config: str) -> None:
        # TOML or JSON text from the operator; nothing to set here.
        pass

    def rank(self, demand: types.Task, victims: types.Allocations) -> list[int]:
        # Victims are allocations; a job (a gang) is evicted whole, so
        # group them by job in order of first appearance.
        jobs: dict[int, list] = {}
        for i, job_id in enumerate(victims.job_ids):
            gpus = float(bin(victims.gpus[i]).count("1")) * float(victims.gpu_milli[i]) / 1000.0
            job = jobs.setdefault(job_id, [victims.priority[i], 0.0, job_id, []])
            job[1] += gpus * float(victims.since_checkpoint_s[i])
            job[3].append(i)
        # Lowest priority, then least work lost, then job id.
        order = sorted(jobs.values(), key=lambda j: (j[0], j[1], j[2]))
        # Every index of the victim list, each once: the host evicts in
        # this order until the demand fits.
        return [i for job in order for i in job[3]]

    # Hooks not claimed in info(): never called.
    def score(self, task, nodes):
        raise Err("not implemented")

    def score_domains(self, task, domains):
        raise Err("not implemented")

    def compact(self, snapshot):
        raise Err("not implemented")

    def pool_place(self, state):
        raise Err("not implemented")

    def pool_step(self, executor):
        raise Err("not implemented")
