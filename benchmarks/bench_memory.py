"""Peak resident memory per rank while building the trainer, per layout: pp1, pp2, ep2, pp2 × ep2.

    python benchmarks/bench_memory.py                      # ~300 MB fp32 model (weights dominate)
    python benchmarks/bench_memory.py --set model.num_layers=8 --layouts pp1,pp2

Each layout runs in fresh gloo processes on CPU (peak RSS is per process, so nothing is shared between
layouts). A rank reports ``ru_maxrss`` (peak RSS) before building anything (imports, process group, the
one-time import of torch's meta kernels)
and after building the model, the difference ("model ΔRSS"), the bytes of the parameters it holds,
and (meta build) the peak after building the whole `Trainer` on top (ZeRO-1 flat buffers, grads and
fp32 masters; pp1 also runs as a process group of one, so it has the same optimizer). Two builds
per layout:

- ``meta``: what the trainer does — the model constructed on the meta device, cut to this rank's
  pipeline chunks and experts, then materialised (only owned parameters are ever allocated);
- ``full``: the way before — every rank builds and initialises the whole fp32 model, then cuts it
  (`build_model` + `apply_expert_parallel` + the pipeline split), for comparison.

Ratios are against pp1 (the single process). Goal (issue 11): ≤ 1/pp of pp1 (+ the embedding and
head) and the experts ≤ 1/ep. Model and build are deterministic; RSS depends on the allocator, so
run the layouts in one invocation to compare them.
"""
from __future__ import annotations

import argparse
import os
import resource
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYOUTS = {"pp1": dict(pp=1, ep=1, world=1), "pp2": dict(pp=2, ep=1, world=2), "ep2": dict(pp=1, ep=2, world=2),
           "pp2_ep2": dict(pp=2, ep=2, world=4)}
# ~76 M parameters (~300 MB fp32): 4 MoE layers of 16 experts (hidden 512, ffn 768) hold 75 M.
DEFAULTS = ["model.hidden_size=512", "model.num_heads=8", "model.num_kv_heads=4", "model.head_dim=64",
            "model.num_layers=4", "model.num_experts=16", "model.moe_ffn_hidden_size=768", "model.vocab_size=2048",
            "schedule.global_batch_size=4", "schedule.micro_batch_size=1", "schedule.seq_len=16",
            "parallel.zero_stage=1", "logging.tensorboard_dir=null", "checkpoint.dir=null", "logging.progress=false",
            "device=cpu"]


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes


class HeapPeak:
    """The peak of the C heap's live bytes while the ``with`` block runs, over the bytes live when
    it starts: glibc's ``mallinfo2`` (``uordblks`` bytes in use in the arenas' chunks + ``hblkhd``
    bytes in mmapped chunks: every ATen CPU tensor's storage, whatever its size), sampled by a
    thread every `interval` seconds (ATen ops release the GIL). What the process's tensors hold at
    their peak, the CPU counterpart of ``torch.cuda.max_memory_allocated``; peak RSS adds the
    allocator's free pages it has not returned to the system (glibc keeps freed heap chunks for
    reuse). ``peak_mb`` is None where the C library has no ``mallinfo2`` (not glibc ≥ 2.33)."""

    def __init__(self, interval: float = 0.001):
        import ctypes

        self.interval, self.peak_mb, self._fn = interval, None, None
        try:
            fn = ctypes.CDLL(None).mallinfo2
        except (AttributeError, OSError):
            return
        fields = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                  "keepcost")
        fn.restype = type("mallinfo2", (ctypes.Structure,), {"_fields_": [(f, ctypes.c_size_t) for f in fields]})
        self._fn = fn

    def live(self) -> int:
        info = self._fn()
        return info.uordblks + info.hblkhd

    def __enter__(self) -> "HeapPeak":
        if self._fn is None:
            return self
        import threading

        self._base = self._max = self.live()
        self._stop = threading.Event()

        def sample():
            while not self._stop.wait(self.interval):
                self._max = max(self._max, self.live())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._fn is None:
            return
        self._stop.set()
        self._thread.join()
        self._max = max(self._max, self.live())
        self.peak_mb = (self._max - self._base) / 2**20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _full_then_cut(cfg, mesh):
    """The build before meta construction: the whole model on every rank, then cut."""
    from megatron_fp4.model import build_model
    from megatron_fp4.parallel.moe.expert_parallel import apply_expert_parallel
    from megatron_fp4.parallel.pipeline import PipelineRunner

    model = build_model(cfg)
    if mesh.ep > 1:
        apply_expert_parallel(model, mesh)
    if mesh.pp > 1:
        PipelineRunner(model, mesh, cfg.parallel.schedule, cfg.parallel.virtual_stages)
    return model


def layout_overrides(spec: dict) -> list:
    """The config overrides of layout `spec`: its axes and its own settings (``extra``: cp trains with FP4 off)."""
    return [f"parallel.pp={spec['pp']}", f"parallel.ep={spec['ep']}", f"parallel.tp={spec.get('tp', 1)}",
            f"parallel.cp={spec.get('cp', 1)}"] + list(spec.get("extra", ()))


def init_rank(rank: int, world: int, port: int, spec: dict, overrides: list):
    """(cfg, mesh) of one spawned rank of layout `spec`: its env, one thread, a gloo group (pp1 too is
    a group of one: the same ZeRO optimizer as the other layouts, like for like), and torch's meta
    kernels imported, so that the caller's RSS baseline is taken after them."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from megatron_fp4.config import default_config_path, load_config
    from megatron_fp4.model import MoETransformer
    from megatron_fp4.parallel.mesh import ParallelMesh

    tp, cp = spec.get("tp", 1), spec.get("cp", 1)  # (bench_memory_plan's tp and cp layouts)
    cfg = load_config(default_config_path(), overrides + layout_overrides(spec))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = ParallelMesh.build(spec["pp"], world // (spec["pp"] * tp), spec["ep"], tp=tp, device=torch.device("cpu"),
                              cp=cp)
    # The first construction on the meta device imports torch's meta kernels (sympy, ~150 MB RSS,
    # once per process, whatever the model size): paid before the baseline, by a 1-layer model.
    warm = load_config(default_config_path(), ["model.num_layers=1"])
    with torch.device("meta"):
        MoETransformer(warm.model, warm.fp4)
    return cfg, mesh


def spawn_layout(target, spec: dict, args: tuple, timeout: float) -> list:
    """Run ``target(rank, world, port, spec, *args, queue)`` on every rank of `spec` (spawned processes)
    and return what each put on the queue, in rank order."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=target, args=(r, spec["world"], port, spec, *args, queue))
             for r in range(spec["world"])]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"a rank exited with code {p.exitcode}")
    return [results[r] for r in range(spec["world"])]


def _rank_main(rank, world, port, spec, overrides, build, queue):
    from megatron_fp4.training.trainer import Trainer

    cfg, mesh = init_rank(rank, world, port, spec, DEFAULTS + overrides)
    before = _peak_mb()
    if build == "meta":  # the trainer's own model build (no optimizer yet), as in Trainer.__init__
        shell = Trainer.__new__(Trainer)
        shell.cfg, shell.mesh, shell.device = cfg, mesh, mesh.device
        model, _ = shell._build_model()
    else:
        model = _full_then_cut(cfg, mesh)
    after = _peak_mb()
    params = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n) / 2**20
    trainer_peak = None
    if build == "meta":  # then the whole trainer: + ZeRO-1 flat buffers, grads and masters
        del model, shell
        Trainer(cfg, mesh, build_data=False)
        trainer_peak = _peak_mb() - before
    queue.put((rank, dict(before=before, after=after, params=params, experts=experts, trainer=trainer_peak)))
    dist.barrier()
    dist.destroy_process_group()


def run_layout(spec: dict, overrides: list, build: str) -> list[dict]:
    return spawn_layout(_rank_main, spec, (overrides, build), timeout=900)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--builds", default="meta,full")
    args = parser.parse_args(argv)
    names = args.layouts.split(",")
    print(f"{'build':5} {'layout':8} {'rank':>4} {'params MB':>10} {'experts MB':>10} {'peak RSS MB':>11} "
          f"{'model ΔRSS MB':>13} {'params/pp1':>10} {'ΔRSS/pp1':>9} {'trainer ΔRSS MB':>15}")
    for build in args.builds.split(","):
        base = None
        for name in names:
            for rank, r in enumerate(run_layout(LAYOUTS[name], args.overrides, build)):
                delta = r["after"] - r["before"]
                if base is None:
                    base = (r["params"], delta)
                print(f"{build:5} {name:8} {rank:>4} {r['params']:>10.1f} {r['experts']:>10.1f} {r['after']:>11.1f} "
                      f"{delta:>13.1f} {r['params'] / base[0]:>10.3f} {delta / base[1]:>9.3f} "
                      f"{'-' if r['trainer'] is None else format(r['trainer'], '15.1f'):>15}", flush=True)


if __name__ == "__main__":
    main()
