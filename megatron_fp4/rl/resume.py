"""The GRPO loop's own state beside the trainer's checkpoint, so a run resumes with batches in flight.

    save_state(root, trainer_step, state, pending)      # before trainer.save_checkpoint(root)
    state, pending = load_state(root, trainer_step)     # after trainer.load_checkpoint(root)

At a checkpoint (``GRPOSettings.checkpoint_every``) the loop waits for the batches in flight and
saves them whole: each one's index, task items and generation (tokens, the behaviour log-probs,
routes, versions per token), with the loop's counters — the next step, the task sampler's and the
minibatch shuffle's RNG states, the dropped/histogram accounting, the greedy eval before RL. A
resumed run takes them as already generated batches, so every batch index is trained once, with
the version that generated it: under ``wait`` the same losses bit for bit as a run never stopped.
Batches trained after the last checkpoint by a run that was killed are trained again after the
resume — their updates were lost with the process, so none counts twice in the weights.

One file per trainer step, ``<checkpoint.dir>/grpo/step_<trainer step>.safetensors``: tensors and
a JSON header (safetensors metadata), never pickle; written before the trainer's checkpoint (an
interrupted save leaves the previous pair), atomically. What is read is checked before use: the
header's fields and sizes, every generation as `rl.rollouts.wire` checks one from a peer.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import safetensors.torch

from megatron_fp4.rl.rollouts.wire import ProtocolError, generation_from_message, generation_message
from megatron_fp4.training.checkpoint.files import fsync_dir, temp_name

FORMAT = 1
MAX_BATCHES = 65  # rl.max_staleness <= 64: at most k + 1 batches in flight
STATE_KEYS = {"format", "step", "launched", "trainer_step", "sampler_rng", "shuffle_rng", "dropped", "histogram",
              "token_histogram", "eval_before", "eval_before_groups", "batches"}


def state_path(root, trainer_step: int) -> Path:
    return Path(root) / "grpo" / f"step_{int(trainer_step):08d}.safetensors"


def rng_state(rng: random.Random) -> list:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_rng_state(rng: random.Random, state, what: str) -> None:
    if not (isinstance(state, list) and len(state) == 3 and type(state[0]) is int and isinstance(state[1], list)
            and len(state[1]) == 625 and all(type(x) is int and 0 <= x < 1 << 32 for x in state[1])
            and (state[2] is None or isinstance(state[2], float))):
        raise ProtocolError(f"the saved GRPO state's {what} is not a random.Random state")
    rng.setstate((state[0], tuple(state[1]), state[2]))


def save_state(root, trainer_step: int, state: dict, pending: list) -> Path:
    """Write the loop's `state` (JSON-able, `STATE_KEYS` but ``batches``) and `pending`: [(index,
    items, generation)] of the batches in flight, all generated. Returns the file's path."""
    tensors, batches = {}, []
    for n, (index, items, gen) in enumerate(pending):
        header, flat = generation_message(gen)
        batches.append({"index": int(index), "items": [list(it) for it in items], "generation": header})
        tensors.update({f"batch{n}.{i}": t.contiguous() for i, t in enumerate(flat)})
    header = json.dumps({**state, "format": FORMAT, "batches": batches})
    path = state_path(root, trainer_step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / temp_name(path.name)
    try:
        with open(tmp, "wb") as f:
            f.write(safetensors.torch.save(tensors, metadata={"grpo_state": header}))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def load_state(root, trainer_step: int) -> tuple[dict, list]:
    """(state, [(index, items, generation)]) saved for `trainer_step`; a clear error if there is none."""
    path = state_path(root, trainer_step)
    if not path.is_file():
        raise FileNotFoundError(f"no GRPO loop state for trainer step {trainer_step} in {path.parent} (the checkpoint "
                                "was not written by the GRPO loop, or by an older version): resume it with "
                                "the trainer alone, or start the GRPO run afresh")
    with safetensors.safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        names = set(f.keys())
        if "grpo_state" not in meta:
            raise ProtocolError(f"{path} holds no 'grpo_state' header: it is not a GRPO loop state")
        state = json.loads(meta["grpo_state"])
        if not isinstance(state, dict) or set(state) != STATE_KEYS or state["format"] != FORMAT:
            raise ProtocolError(f"{path}: the GRPO state header must be an object with {sorted(STATE_KEYS)} "
                                f"(format {FORMAT})")
        for key in ("step", "launched", "trainer_step", "dropped"):
            if type(state[key]) is not int or state[key] < 0:
                raise ProtocolError(f"{path}: {key}={state[key]!r} is not a non-negative integer")
        if state["trainer_step"] != trainer_step:
            raise ProtocolError(f"{path} is the state of trainer step {state['trainer_step']}, not {trainer_step}")
        batches = state.pop("batches")
        if not isinstance(batches, list) or len(batches) > MAX_BATCHES:
            raise ProtocolError(f"{path}: 'batches' must be a list of at most {MAX_BATCHES} batches in flight")
        pending = []
        for n, b in enumerate(batches):
            if not (isinstance(b, dict) and set(b) == {"index", "items", "generation"} and type(b["index"]) is int
                    and isinstance(b["items"], list)
                    and all(isinstance(it, list) and len(it) == 3 for it in b["items"])):
                raise ProtocolError(f"{path}: batch {n} must be {{index, items (each [ids, text, reference]), "
                                    "generation}")
            keys = sorted((k for k in names if k.startswith(f"batch{n}.")), key=lambda k: int(k.split(".")[1]))
            gen = generation_from_message(b["generation"], [f.get_tensor(k) for k in keys])
            if len(b["items"]) != len(gen.prompt_ids):
                raise ProtocolError(f"{path}: batch {n} has {len(b['items'])} items for {len(gen.prompt_ids)} prompts")
            items = [tuple(tuple(x) if isinstance(x, list) and i == 2 else x for i, x in enumerate(it))
                     for it in b["items"]]
            pending.append((b["index"], items, gen))
    state["histogram"] = {int(k): int(v) for k, v in state["histogram"].items()}
    state["token_histogram"] = {int(k): int(v) for k, v in state["token_histogram"].items()}
    return state, pending
