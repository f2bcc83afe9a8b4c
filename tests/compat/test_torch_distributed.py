"""The training ranks' rendezvous on loopback (``periodic_rl.compat.torch_distributed``): two
gloo ranks started through ``env://`` with ``MASTER_ADDR`` 127.0.0.1 listen on loopback only,
and still reduce. (Without it, torch's store listens on every interface: the mutation
"rendezvous store on every interface" in tests/mutations.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, os, random, socket, sys
    import psutil, torch, torch.distributed as dist
    import torch.multiprocessing as mp
    from periodic_rl.compat.torch_distributed import is_loopback, loopback_rendezvous

    def run(rank, port, use_fix, out):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        context = loopback_rendezvous() if use_fix else __import__("contextlib").nullcontext()
        with context:
            dist.init_process_group("gloo", rank=rank, world_size=2)
        value = torch.ones(1)
        dist.all_reduce(value)
        group = dist.new_group(backend="gloo")  # a second group, as the rank link makes
        dist.all_reduce(value, group=group)
        listening = [
            c.laddr.ip for c in psutil.net_connections("inet")
            if c.pid == os.getpid() and c.status == psutil.CONN_LISTEN
        ]
        dist.barrier()
        with open(f"{out}-{rank}.json", "w") as handle:
            json.dump({"sum": value.item(), "listening": listening}, handle)
        dist.destroy_process_group()

    def free_port(rng):
        # free now, and below the kernel's ephemeral range: no outgoing connection of another
        # process can take it before the ranks bind it
        while True:
            port = rng.randrange(20000, 32000)
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port

    if __name__ == "__main__":
        rng = random.Random(os.getpid())
        for attempt in range(5):  # another listener may still bind the port meanwhile
            try:
                mp.spawn(run, args=(free_port(rng), sys.argv[1] == "fix", sys.argv[2]), nprocs=2)
                break
            except mp.ProcessRaisedException as error:
                if "Address already in use" not in str(error) or attempt == 4:
                    raise
    """
)


def _ranks(tmp_path, mode: str) -> list[dict]:
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    out = tmp_path / mode
    subprocess.run([sys.executable, str(script), mode, str(out)], check=True, timeout=300)
    return [json.loads((tmp_path / f"{mode}-{rank}.json").read_text()) for rank in (0, 1)]


def test_two_ranks_rendezvous_on_loopback_only(tmp_path):
    from periodic_rl.compat.torch_distributed import is_loopback

    fixed = _ranks(tmp_path, "fix")
    assert [r["sum"] for r in fixed] == [4.0, 4.0]  # two all-reduces of ones over 2 ranks
    assert fixed[0]["listening"], "rank 0 serves the store: the check would prove nothing"
    assert all(is_loopback(ip) for r in fixed for ip in r["listening"])
