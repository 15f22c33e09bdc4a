"""Every launch command shown in the README, docs/usage.md, docs/parallel.md and the launchers' own
comments trains a layout that validates at the world size the command starts (issue 17 row 5: the multi-node examples
used to ask for dp 8 with a global batch that 4×8 does not divide)."""
import re
import shlex
from pathlib import Path

import pytest

from megatron_fp4.config import default_config_path, load_config
from megatron_fp4.parallel.dims import ParallelDims
from megatron_fp4.train import parse_args

REPO = Path(__file__).resolve().parents[2]
SOURCES = ["README.md", "docs/usage.md", "docs/parallel.md", "tools/launchers/train.sh", "tools/launchers/slurm_train.sbatch"]
LAUNCHERS = ("torchrun", "tools/launchers/train.sh", "sbatch", "megatron-fp4-train")


def commands(text: str) -> list[str]:
    """Launch commands in `text`: lines (or `# `-comment lines) starting with a launcher, with
    their backslash continuations joined and trailing comments dropped."""
    found, current = [], None
    for raw in text.splitlines():
        line = re.sub(r"^#\s*", "", raw.strip()) if raw.lstrip().startswith("#") else raw.strip()
        if current is not None:
            current += " " + line
        elif any(re.match(rf"^([A-Z_]+=\S+\s+)*{re.escape(name)}\s+(\d|--|\S+\.sbatch)", line) for name in LAUNCHERS):
            current = line
        else:
            continue
        if current.endswith("\\"):
            current = current[:-1]
        else:
            found.append(re.sub(r"\s+#.*$", "", current))
            current = None
    return found


def world_and_args(command: str) -> tuple[int, list[str]]:
    """(world size, megatron_fp4.train arguments) of one launch command."""
    words = shlex.split(command)
    env = {}
    while "=" in words[0]:
        key, value = words.pop(0).split("=", 1)
        env[key] = value

    def option(name, default):
        for i, w in enumerate(words):
            if w == name:
                return words[i + 1]
            if w.startswith(name + "="):
                return w.split("=", 1)[1]
        return default

    def after_dashdash(rest):
        return rest[rest.index("--") + 1:] if "--" in rest else rest

    launcher = words[0]
    if launcher == "megatron-fp4-train":
        return 1, words[1:]
    if launcher == "torchrun":
        world = int(option("--nproc-per-node", 1)) * int(option("--nnodes", 1))
        if "-m" in words:
            return world, words[words.index("-m") + 2:]
        # a script (examples/grpo_moeresq.py): its own flags, but the layout comes from its `--set`s
        rest = words[next(i for i, w in enumerate(words) if w.endswith(".py")) + 1:]
        return world, [a for i, w in enumerate(rest) if w == "--set" for a in ("--set", rest[i + 1])]
    if launcher == "tools/launchers/train.sh":
        return int(words[1]), after_dashdash(words[2:])
    script = next(i for i, w in enumerate(words) if w.endswith("slurm_train.sbatch"))
    per_node = env.get("NPROC_PER_NODE") or option("--gpus-per-node", None)
    assert per_node, f"{command}: say how many processes per node (--gpus-per-node or NPROC_PER_NODE)"
    return int(option("--nodes", 1)) * int(per_node), after_dashdash(words[script + 1:])


def all_commands():
    return [(source, c) for source in SOURCES for c in commands((REPO / source).read_text())]


def test_every_source_shows_launch_commands():
    per_source = {source: sum(1 for s, _ in all_commands() if s == source) for source in SOURCES}
    assert all(per_source.values()), per_source
    assert any(c.startswith("sbatch") for _, c in all_commands())


@pytest.mark.parametrize("source,command", all_commands())
def test_example_config_validates_at_its_world_size(source, command):
    world, argv = world_and_args(command)
    args = parse_args(argv)
    overrides = args.overrides + ([f"schedule.train_steps={args.steps}"] if args.steps is not None else [])
    cfg = load_config(REPO / args.config if args.config else default_config_path(), overrides)
    if args.steps is not None and cfg.schedule.warmup_steps > args.steps:
        cfg.schedule.warmup_steps = args.steps // 10  # as the CLI does for --steps
    ParallelDims.from_config(cfg.validate(), world)


def test_parser_reads_world_size_and_trainer_args():
    cmd, = commands("#   sbatch --nodes=2 --gpus-per-node=8 tools/launchers/slurm_train.sbatch \\\n"
                    "#       --max-restarts 1 -- --set parallel.pp=2   # note\n")
    assert world_and_args(cmd) == (16, ["--set", "parallel.pp=2"])
    cmd, = commands("OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 -m megatron_fp4.train --steps 3\n")
    assert world_and_args(cmd) == (4, ["--steps", "3"])


def test_a_layout_error_under_a_launcher_names_the_process_count(monkeypatch, capsys):
    from megatron_fp4.train import EXIT_USER_ERROR, main

    monkeypatch.setenv("WORLD_SIZE", "8")  # what the old sbatch started on a CPU node
    monkeypatch.setenv("RANK", "0")
    assert main(["--steps", "1"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "schedule.global_batch_size=16" in err and "this job started 8 processes" in err, err
    assert "NPROC_PER_NODE" in err
