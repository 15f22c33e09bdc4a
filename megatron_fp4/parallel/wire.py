"""Messages between processes: a JSON header and a tensor payload over a group, never pickle.

The one framing every cross-process exchange of ours uses (checkpoint verdicts, the weight-sync
protocol, the sharded publisher's agreement on names, the pipeline's loss report, rollout requests
and results):

- a JSON value travels as its UTF-8 bytes in a uint8 tensor behind an int64 length
  (`broadcast_json`, `all_gather_json`). The length is checked against a bound before anything is
  allocated; what arrives is parsed with `json.loads` only, so a peer's bytes are data, never code;
- a message (`broadcast_message`) is a JSON envelope ``{"header": ..., "tensors": [[dtype, shape],
  ...]}`` and then every tensor's bytes back to back in one uint8 payload. The receiver checks the
  envelope's form, the dtypes (plain numeric torch dtypes by name), the shapes, the payload's total
  size against its bound and, with ``expect``, the exact dtypes and shapes it requires from the
  header, all before it allocates the payload.

`group` is always given: a `torch.distributed` process group (None: the default group; `src` is
then a global rank, as torch.distributed takes it) or a group of its own outside torch.distributed's
registry — any object with ``rank()``, ``size()``, ``broadcast(tensor, src)`` and
``all_gather(tensor) -> list`` (e.g. `rollout.weight_sync.peer_group.PeerGroup`; `src` is a group rank).
`ProtocolError` is a message the framing refuses; `MalformedMessage` one that arrived whole but is
not JSON (the exchange can go on).
"""
from __future__ import annotations

import json
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

MAX_JSON_BYTES = 1 << 30  # a JSON message (a weight-sync manifest of ~10^6 chunks fits); more is refused
MAX_PAYLOAD_BYTES = 1 << 32  # a message's tensors together, unless the caller bounds them tighter
PAYLOAD_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64)}


class ProtocolError(RuntimeError):
    """A message is not what the protocol allows (not JSON, wrong form, too large)."""


class MalformedMessage(ProtocolError):
    """A message arrived whole but is not JSON of the expected form (the exchange can go on)."""


# -- groups -----------------------------------------------------------------------------------------
def is_peer_group(group) -> bool:
    return group is not None and not isinstance(group, dist.ProcessGroup)


def group_rank(group) -> int:
    return group.rank() if is_peer_group(group) else dist.get_rank(group)


def group_size(group) -> int:
    return group.size() if is_peer_group(group) else dist.get_world_size(group)


def is_src(src: int, group) -> bool:
    """`src` is a group rank for a peer group, a global rank for a torch.distributed group."""
    return (group.rank() if is_peer_group(group) else dist.get_rank()) == src


def broadcast_tensor(tensor: torch.Tensor, src: int, group) -> None:
    if is_peer_group(group):
        group.broadcast(tensor, src)
    else:
        dist.broadcast(tensor, src=src, group=group)


def all_gather_tensor(tensor: torch.Tensor, group) -> list:
    if is_peer_group(group):
        return group.all_gather(tensor)
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor, group=group)
    return out


# -- JSON -------------------------------------------------------------------------------------------
def encode_json(obj, device: Optional[torch.device] = None) -> torch.Tensor:
    """`obj` as JSON bytes in a uint8 tensor."""
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device or "cpu")


def decode_json(payload: torch.Tensor, sender: str):
    """The JSON value in uint8 `payload` (from `sender`, named in the error); never unpickles."""
    try:
        return json.loads(payload.cpu().numpy().tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise MalformedMessage(f"{sender} sent a message that is not JSON ({type(err).__name__}); it was not "
                               "used (messages between processes are JSON, never pickle)") from None


def broadcast_json(obj, src: int, group, device: Optional[torch.device] = None, max_bytes: int = MAX_JSON_BYTES,
                   sender: Optional[str] = None):
    """`obj` from `src`, parsed as JSON everywhere else (their `obj` is ignored). Every rank refuses a
    length outside 1..`max_bytes` before allocating (the sender too, so no rank waits for bytes)."""
    device = device or torch.device("cpu")
    me = is_src(src, group)
    payload = encode_json(obj, device) if me else None
    length = torch.tensor([payload.numel() if me else 0], dtype=torch.int64, device=device)
    broadcast_tensor(length, src, group)
    n = int(length.item())
    if not 0 < n <= max_bytes:
        raise ProtocolError(f"rank {src} announced a {n}-byte message (allowed: 1..{max_bytes})")
    if payload is None:
        payload = torch.empty(n, dtype=torch.uint8, device=device)
    broadcast_tensor(payload, src, group)
    return obj if me else decode_json(payload, sender or f"rank {src}")


def all_gather_json(obj, group, device: Optional[torch.device] = None, max_bytes: int = MAX_JSON_BYTES,
                    strict: bool = True, what: str = "message") -> list:
    """Every group rank's `obj`, in group-rank order. A rank whose message is not JSON or longer than
    `max_bytes` raises `ProtocolError` (`strict`) or has the error as its entry; either way every rank
    takes part in the same two all-gathers (lengths, then bytes padded to the longest that fits)."""
    device = device or torch.device("cpu")
    payload = encode_json(obj, device)
    lengths = [int(n.item()) for n in all_gather_tensor(
        torch.tensor([payload.numel()], dtype=torch.int64, device=device), group)]
    fits = [0 < n <= max_bytes for n in lengths]
    padded = torch.zeros(max([1] + [n for n, ok in zip(lengths, fits) if ok]), dtype=torch.uint8, device=device)
    if fits[group_rank(group)]:
        padded[:payload.numel()] = payload
    parts = all_gather_tensor(padded, group)
    out = []
    for rank, (part, n, ok) in enumerate(zip(parts, lengths, fits)):
        try:
            if not ok:
                raise ProtocolError(f"group rank {rank} announced a {n}-byte {what} (allowed: 1..{max_bytes}); "
                                    "it was not read")
            out.append(decode_json(part[:n], f"group rank {rank}"))
        except ProtocolError as err:
            if strict:
                raise
            out.append(err)
    return out


# -- header + tensor payload ------------------------------------------------------------------------
def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def tensor_specs(tensors: Sequence[torch.Tensor]) -> list:
    """The envelope's ``tensors`` entry: [dtype name, shape] per tensor."""
    specs = []
    for t in tensors:
        name = str(t.dtype).removeprefix("torch.")
        if name not in PAYLOAD_DTYPES:
            raise ValueError(f"a {t.dtype} tensor cannot travel in a message (dtypes: {sorted(PAYLOAD_DTYPES)})")
        specs.append([name, list(t.shape)])
    return specs


def parse_specs(obj, sender: str) -> list:
    """[(shape, dtype)] of an envelope's ``tensors``; refuses unknown dtypes and malformed shapes."""
    if not isinstance(obj, list):
        raise ProtocolError(f"{sender}: a message's tensors must be a list of [dtype, shape]")
    specs = []
    for spec in obj:
        if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], list)
                and len(spec[1]) <= 16 and all(type(s) is int and s >= 0 for s in spec[1])):
            raise ProtocolError(f"{sender}: a tensor must be [dtype, shape] (shape: at most 16 non-negative "
                                f"integers), got {str(spec)[:200]}")
        if spec[0] not in PAYLOAD_DTYPES:
            raise ProtocolError(f"{sender}: dtype {spec[0][:40]!r} is not one a message carries "
                                f"({sorted(PAYLOAD_DTYPES)})")
        specs.append((tuple(spec[1]), PAYLOAD_DTYPES[spec[0]]))
    return specs


def payload_bytes(specs: list) -> int:
    total = 0
    for shape, dtype in specs:
        n = dtype.itemsize
        for s in shape:
            n *= s
        total += n
    return total


def check_specs(specs: list, expected: Optional[list], max_bytes: int, sender: str) -> int:
    """The payload's size in bytes once `specs` are what the receiver expects (when it says) and fit
    `max_bytes` — checked before anything is allocated."""
    if expected is not None:
        expected = [(tuple(shape), dtype) for shape, dtype in expected]
        if specs != expected:
            got = [(list(s), str(d).removeprefix("torch.")) for s, d in specs]
            want = [(list(s), str(d).removeprefix("torch.")) for s, d in expected]
            raise ProtocolError(f"{sender} sent tensors {str(got)[:300]} where {str(want)[:300]} were expected")
    total = payload_bytes(specs)
    if total > max_bytes:
        raise ProtocolError(f"{sender} announced a {total}-byte payload (allowed: at most {max_bytes})")
    return total


def pack_payload(tensors: Sequence[torch.Tensor], device: Optional[torch.device] = None) -> torch.Tensor:
    """Every tensor's bytes back to back (uint8)."""
    parts = [_bytes_of(t).to(device or "cpu") for t in tensors]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device or "cpu")


def unpack_payload(payload: torch.Tensor, specs: list, sender: str = "the sender") -> list:
    """The tensors of `specs` from uint8 `payload` (fresh tensors); a payload that is shorter or
    longer than the specs (truncated, or bytes left over) is refused."""
    total = payload_bytes(specs)
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != total:
        raise ProtocolError(f"{sender}: a payload of {payload.numel()} {payload.dtype} elements where the "
                            f"header declares {total} bytes (truncated or malformed)")
    out, at = [], 0
    for shape, dtype in specs:
        n = payload_bytes([(shape, dtype)])
        out.append(payload[at:at + n].clone().view(dtype).reshape(shape))  # clone: aligned for the view
        at += n
    return out


def broadcast_message(header, tensors: Optional[Sequence[torch.Tensor]], src: int, group,
                      device: Optional[torch.device] = None, expect: Optional[Callable] = None,
                      max_header_bytes: int = MAX_JSON_BYTES, max_payload_bytes: int = MAX_PAYLOAD_BYTES,
                      sender: Optional[str] = None) -> tuple:
    """(header, tensors) of `src`'s message on every rank (the others pass None, None). `expect(header)`
    -> [(shape, dtype)] the receiver requires for that header (it may raise `ProtocolError` about the
    header itself); compared before the payload is allocated. The source gets its own tensors back;
    a receiver gets fresh ones on `device`."""
    device = device or torch.device("cpu")
    sender = sender or f"rank {src}"
    me = is_src(src, group)
    envelope = {"header": header, "tensors": tensor_specs(tensors or [])} if me else None
    envelope = broadcast_json(envelope, src, group, device, max_header_bytes, sender)
    if not isinstance(envelope, dict) or set(envelope) != {"header", "tensors"}:
        raise ProtocolError(f"{sender}: a message must be {{'header': ..., 'tensors': [[dtype, shape], ...]}}")
    header, specs = envelope["header"], parse_specs(envelope["tensors"], sender)
    total = check_specs(specs, None if expect is None else expect(header), max_payload_bytes, sender)
    if me:
        if total:
            broadcast_tensor(pack_payload(tensors, device), src, group)
        return header, list(tensors or [])
    payload = torch.empty(total, dtype=torch.uint8, device=device)
    if total:
        broadcast_tensor(payload, src, group)
    return header, unpack_payload(payload, specs, sender)
