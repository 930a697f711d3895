"""Closed distributed paths (swiftspec.distributed.rendezvous, .wire, swiftspec.pipeline.control): no
object collective or unpickling of peer data anywhere in the package, the control message's tensor
layout, the shared secret's checks, and a local TP run with no listener outside loopback."""
import os
import re
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from swiftspec import Engine, SamplingParams
from swiftspec.distributed import rendezvous, wire
from swiftspec.pipeline.control import Control, Work, decode, encode

PACKAGE = Path(__file__).resolve().parents[1] / "swiftspec"
UNPICKLING = re.compile(r"\b(broadcast_object_list|all_gather_object|gather_object|scatter_object_list|"
                        r"send_object_list|recv_object_list|pickle\.loads?|torch\.load)\s*\(")


def test_no_object_collective_or_unpickling_in_the_package():
    hits = [f"{p.relative_to(PACKAGE)}:{i}: {line.strip()}" for p in sorted(PACKAGE.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if UNPICKLING.search(line)]
    assert not hits, "peer data must travel as tensors (swiftspec.distributed.wire), never pickled:\n" + "\n".join(hits)


def _work(n, width, keep=None, tokens=True, logit_rows=()):
    g = torch.Generator().manual_seed(n * 31 + width)
    return Work(n + 2 if keep is not None else 0, keep, torch.arange(n) + 5, torch.arange(n) * 3,
                torch.rand(n, width, generator=g) > 0.5, torch.arange(n) + 100 if tokens else None, list(logit_rows))


def test_control_round_trips_and_refuses_malformed_input():
    ctrl = Control("step", [_work(3, 7), None, _work(2, 9, keep=[0, 3], tokens=False, logit_rows=[1]),
                            _work(0, 4, keep=[], tokens=False)], (torch.tensor([4, 5]), torch.tensor([1, 2])))
    got = decode(encode(ctrl))
    assert got.op == "step" and got.work[1] is None and [m.tolist() for m in got.moves] == [[4, 5], [1, 2]]
    for a, b in zip(ctrl.work, got.work):
        if a is None:
            continue
        assert (b.in_rows, b.keep, b.logit_rows) == (a.in_rows, a.keep, a.logit_rows)
        for x, y in ((a.positions, b.positions), (a.slots, b.slots), (a.mask, b.mask), (a.tokens, b.tokens)):
            assert (x is None and y is None) or torch.equal(x, y)
    assert decode(encode(Control("end"))) == Control("end")
    t = encode(ctrl)
    for bad in (t[:-1], torch.cat([t, t[:1]]), torch.tensor([7, 0, -1]), torch.tensor([0, 1, -1, 1, 0, 0, 10**12, 1, 0, 0])):
        with pytest.raises(RuntimeError, match="malformed pipeline control"):
            decode(bad)
    with pytest.raises(ValueError, match="control op"):
        encode(Control("exec"))


def test_wire_messages_in_a_one_rank_world(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        assert wire.broadcast_bytes(b"abc\0", 0) == b"abc\0" and wire.broadcast_bytes(b"", 0) == b""
        assert wire.all_gather_bytes(b"host") == [b"host"]
        assert wire.all_gather_flags(True) == [True]
        assert wire.all_gather_json({"a": [1, 2.5, "x"]}) == [{"a": [1, 2.5, "x"]}]
        with pytest.raises(RuntimeError, match="refused"):
            wire.all_gather_bytes(b"x" * 65, max_bytes=64)
    finally:
        dist.destroy_process_group()


def test_pipeline_token_rules():
    with pytest.raises(ValueError, match=rendezvous.TOKEN_ENV):
        rendezvous.pipeline_token({})
    with pytest.raises(ValueError, match="at least 16"):
        rendezvous.pipeline_token({rendezvous.TOKEN_ENV: "short"})
    a, b = "s" * 16, "t" * 16
    assert rendezvous.pipeline_token({rendezvous.TOKEN_ENV: a}) == a
    assert rendezvous.token_prefix(a) != rendezvous.token_prefix(b)
    assert rendezvous.token_prefix(a) == rendezvous.token_prefix(a) and a not in rendezvous.token_prefix(a)
    d = rendezvous.private_dir()
    try:
        assert os.stat(d).st_mode & 0o777 == 0o700
    finally:
        os.rmdir(d)


def _listeners(pids: list[int]) -> list[str]:
    """``host:port`` (hex, as /proc/net/tcp writes it) of every TCP socket in LISTEN state owned by ``pids``."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                out.append(f[1])
    return out


def _loopback(addr: str) -> bool:
    host = addr.split(":")[0]
    if len(host) == 8:  # IPv4, little-endian hex: 127.x.x.x ends in 7F
        return host.endswith("7F")
    return host == "00000000000000000000000001000000" or host.startswith("0000000000000000FFFF0000") and host.endswith("7F")


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_local_tensor_parallel_run_listens_on_loopback_only(tiny_dir):
    with Engine(tiny_dir, mode="autoregressive", dtype="float32", target_tp=2) as eng:
        assert len(eng.generate("hello", SamplingParams(max_tokens=4, ignore_eos=True)).token_ids) == 4
        found = _listeners(eng.pids)
        rdzv = list(eng._processes.dirs)
    assert found, "gloo's pair sockets listen: the probe must see them"
    assert all(_loopback(a) for a in found), f"listeners outside loopback: {found}"
    assert rdzv and not any(os.path.exists(d) for d in rdzv), "the private rendezvous directory outlives the engine"
