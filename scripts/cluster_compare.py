#!/usr/bin/env python3
"""rdist and its peers across hosts: a namespace cluster on this machine
(scripts/cluster.sh), links shaped to RATE, the same native workers as the
loopback comparison (bench/peers: native_bench.c for rdist, Open MPI and
MPICH, gloo_bench.cc for Gloo; torch_bench.py for torch's gloo under
torchrun), one run, same timing method.

For each op and size the table gives busbw (nccl-tests definitions), its
fraction of the link-bound busbw, and rdist / best peer. The link bound:
with H hosts of P ranks (n = H*P) each behind one link of rate B, allreduce
must move 2(H-1)/H of the data through every host's link, allgather and
reduce_scatter (H-1)/H, broadcast all of it once, so the highest busbw the
links allow is B*(n-1)/n*H/(H-1) for allreduce, allgather and
reduce_scatter and B for broadcast. B is
given two ways: the nominal rate (tbf) and the goodput of one bulk TCP
stream between two hosts, measured in the same run (what TCP's headers
leave of the link).

Usage (root; called by scripts/compare.sh --cluster):
  cluster_compare.py --bin DIR --hosts 3 --per-host 2 --rate 1gbit --outdir build/compare
DIR holds rdist_bench, gloo_bench, mpi_bench_openmpi and mpi_bench_mpich
(compare.sh builds them); --mpich names MPICH's bin/, --torch-python a
Python with torch (torchrun per host runs bench/peers/torch_bench.py).
Writes cluster-<date>.json, cluster-<date>.md (and .png with matplotlib).
"""
import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER = os.path.join(ROOT, "scripts", "cluster.sh")
MiB = 1 << 20


def sh(*args, check=True, timeout=None, **kw):
    return subprocess.run(list(args), check=check, timeout=timeout, text=True,
                          capture_output=True, **kw)


def cluster(*args, **kw):
    return sh("bash", CLUSTER, *args, **kw)


def rate_bytes(rate):
    """tbf rate ("1gbit", "500mbit") in bytes per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[: -len(u)]) * f / 8
    raise SystemExit(f"cluster_compare: cannot read rate {rate!r} (e.g. 1gbit)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STREAM = r"""
import socket, sys, time
mode, addr, port, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
if mode == "recv":
    l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    l.bind((addr, port)); l.listen(1); c, _ = l.accept()
    buf = bytearray(4 << 20); n = 0; t0 = None
    while True:
        k = c.recv_into(buf)
        if not k: break
        if t0 is None: t0 = time.monotonic()
        elif time.monotonic() - t0 > 1.0: n += k
        if t0 and time.monotonic() - t0 > secs: break
    print(n / (time.monotonic() - t0 - 1.0))
else:
    for _ in range(100):
        try: c = socket.create_connection((addr, port)); break
        except OSError: time.sleep(0.05)
    data = bytes(4 << 20); end = time.monotonic() + secs + 1.5
    try:
        while time.monotonic() < end: c.sendall(data)
    except OSError: pass
"""


def tcp_goodput(name, secs=4.0):
    """Bytes/s of one bulk TCP stream from host 1 to host 0 (first second
    left out: slow start)."""
    addr0 = cluster("addr", "0", "--name", name).stdout.strip()
    port = free_port()
    recv = subprocess.Popen(["bash", CLUSTER, "exec", "0", "--name", name, "--",
                             sys.executable, "-c", STREAM, "recv", addr0, str(port), str(secs)],
                            stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    cluster("exec", "1", "--name", name, "--", sys.executable, "-c", STREAM, "send", addr0,
            str(port), str(secs), timeout=secs + 30)
    out, _ = recv.communicate(timeout=30)
    return float(out.strip())


def run_on_hosts(name, command, timeout):
    """Runs a shell command in every host at once (CLUSTER_HOST set)."""
    r = cluster("run", "--name", name, "--", "sh", "-c", command, check=False, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError((r.stdout + r.stderr)[-3000:])


def workers_env(a, out):
    return (f"OUT={out} AR_SIZES={a.sizes} BC_SIZES={a.sizes} AG_SIZES={a.sizes} RS_SIZES={a.sizes} "
            f"PP_SIZES={a.p2p_sizes} EX_SIZES={a.p2p_sizes} "
            f"BATCH={a.batch} REPS={a.reps} OMP_NUM_THREADS=1")


def each_rank(a, command):
    """A shell loop starting `command` once per rank of this host."""
    return (f"for l in $(seq 0 {a.per_host - 1}); do "
            f"RANK=$((CLUSTER_HOST * {a.per_host} + l)) SIZE={a.hosts * a.per_host} {command} & "
            f"done; wait")


def rsh_agent(a, name):
    """An rsh agent for MPI launchers (cluster.sh rsh), the hosts'
    addresses, and the launcher's host list (ADDR:per_host,...)."""
    addrs = [cluster("addr", str(k), "--name", name).stdout.strip() for k in range(a.hosts)]
    agent = os.path.join(a.outdir, f"netns-rsh-{name}")
    with open(agent, "w") as f:
        f.write(f'#!/bin/sh\nexec bash {CLUSTER} rsh --name {name} "$@"\n')
    os.chmod(agent, 0o755)
    return agent, addrs, ",".join(f"{x}:{a.per_host}" for x in addrs)


def launch_from_host0(a, agent, addrs, command):
    """Runs an MPI launcher's command line in host 0, through the agent."""
    try:
        r = sh(agent, addrs[0], command, check=False, timeout=a.timeout)
    finally:
        os.unlink(agent)
    if r.returncode != 0:
        raise RuntimeError((r.stdout + r.stderr)[-3000:])


def run_peer(peer, a, name, out):
    env = workers_env(a, out)
    n = a.hosts * a.per_host
    if peer == "rdist":
        port = free_port()
        cmd = each_rank(a, f"{env} PORT={port} MASTER_ADDR=$CLUSTER_MASTER "
                           f"LD_LIBRARY_PATH={a.lib} {a.bin}/rdist_bench")
        run_on_hosts(name, cmd, a.timeout)
        return "rdist native C (shared memory within a host, TCP between hosts)"
    if peer == "gloo-native":
        store = f"/tmp/gloo-store-{os.getpid()}"
        os.makedirs(store, exist_ok=True)
        cmd = each_rank(a, f"{env} PREFIX=c{time.time_ns()} STORE={store} IFACE=eth0 "
                           f"{a.bin}/gloo_bench")
        try:
            run_on_hosts(name, cmd, a.timeout)
        finally:
            sh("rm", "-rf", store, check=False)
        return "Gloo native (Debian libgloo), TCP on eth0"
    if peer == "openmpi-c":
        agent, addrs, hosts = rsh_agent(a, name)
        mpirun = (f"{env} mpirun --allow-run-as-root --oversubscribe --bind-to none -np {n} "
                  f"--host {hosts} --mca plm_rsh_agent {agent} --mca btl tcp,self,vader "
                  f"--mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 "
                  f"-x OUT -x AR_SIZES -x BC_SIZES -x AG_SIZES -x RS_SIZES -x PP_SIZES -x EX_SIZES -x BATCH -x REPS "
                  f"-x OMP_NUM_THREADS {a.bin}/mpi_bench_openmpi")
        launch_from_host0(a, agent, addrs, mpirun)
        return "Open MPI native C (vader shared memory within a host, TCP between hosts)"
    if peer == "mpich-c":
        # Hydra launches its proxies through the same rsh agent. MPICH's
        # default network module (UCX) finds the other "hosts" on the same
        # boot id and shares memory with them, past the shaped links (64 MiB
        # allgather in 44 ms, nothing on eth0): the network goes through
        # OFI's TCP provider instead, shared memory stays inside a host.
        agent, addrs, hosts = rsh_agent(a, name)
        mpiexec = (f"{env} MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=eth0 "
                   f"{a.mpich}/mpiexec -launcher ssh -launcher-exec {agent} -iface eth0 "
                   f"-hosts {hosts} -n {n} {a.bin}/mpi_bench_mpich")
        launch_from_host0(a, agent, addrs, mpiexec)
        return "MPICH native C (PyPI wheel; ch4 posix shared memory within a host, OFI TCP between)"
    if peer == "torch-gloo":
        port = free_port()
        cmd = (f"{env} GLOO_SOCKET_IFNAME=eth0 {a.torch_python} -m torch.distributed.run "
               f"--nnodes {a.hosts} --node-rank $CLUSTER_HOST --nproc-per-node {a.per_host} "
               f"--master-addr $CLUSTER_MASTER --master-port {port} "
               f"{os.path.join(ROOT, 'bench', 'peers', 'torch_bench.py')}")
        run_on_hosts(name, cmd, a.timeout)
        return "torch.distributed gloo (PyPI torch) under torchrun, one per host, TCP on eth0"
    raise SystemExit(f"cluster_compare: unknown peer {peer}")


# Ops reported as a time per operation, not a bandwidth.
TIMED = ("barrier", "pingpong", "exchange")


def busbw(op, nbytes, t, n):
    algbw = nbytes / t
    if op == "allreduce":
        return algbw * 2 * (n - 1) / n
    if op in ("allgather", "reduce_scatter"):
        return algbw * (n - 1) / n
    return algbw


def link_bound(op, link, hosts, n):
    """The highest busbw links of `link` bytes/s allow (see the header)."""
    if op in ("allreduce", "allgather", "reduce_scatter"):
        return link * (n - 1) / n * hosts / (hosts - 1)
    return link


def fmt_size(b):
    return f"{b // MiB} MiB" if b >= MiB else f"{b // 1024} KiB" if b >= 1024 else f"{b} B"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", required=True)
    p.add_argument("--lib", default=os.path.join(ROOT, "target", "release"))
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--per-host", type=int, default=2)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--cc", default="",
                   help="the hosts' TCP congestion control (cubic, bbr, ...; default: this machine's)")
    p.add_argument("--sizes", default=f"{4 * MiB},{64 * MiB}",
                   help="allreduce, broadcast and allgather sizes ('' for none)")
    p.add_argument("--p2p-sizes", default="",
                   help="ping-pong (ranks 2i, 2i+1: across hosts with --per-host 1) and ring "
                        "exchange sizes, e.g. 8,4096,65536,1048576,16777216 (native workers only)")
    p.add_argument("--peers", default="rdist,gloo-native,torch-gloo,openmpi-c,mpich-c")
    p.add_argument("--mpich", default="", help="bin/ of the MPICH venv (mpiexec); without it, no mpich-c")
    p.add_argument("--torch-python", default="", help="a Python with torch; without it, no torch-gloo")
    p.add_argument("--batch", type=float, default=0.5)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--outdir", default=os.path.join(ROOT, "build", "compare"))
    a = p.parse_args()
    if a.hosts < 2:
        raise SystemExit("cluster_compare: needs at least 2 hosts")
    wanted = a.peers.split(",")
    for peer, have in (("mpich-c", a.mpich and os.path.exists(os.path.join(a.bin, "mpi_bench_mpich"))),
                       ("torch-gloo", a.torch_python)):
        if peer in wanted and not have:
            print(f"cluster_compare: skipped: {peer} (not installed)", flush=True)
            wanted.remove(peer)
    a.peers = ",".join(wanted)
    os.makedirs(a.outdir, exist_ok=True)
    a.outdir = os.path.abspath(a.outdir)
    name = f"rdcmp{os.getpid() % 10000}"
    n = a.hosts * a.per_host
    up = cluster("up", str(a.hosts), "--rate", a.rate, *(("--cc", a.cc) if a.cc else ()),
                 "--name", name, check=False)
    if up.returncode != 0:
        raise SystemExit(f"cluster_compare: cluster.sh up failed: {up.stderr.strip()}")
    records, meta = [], {"hosts": a.hosts, "per_host": a.per_host, "rate": a.rate,
                         "date": datetime.date.today().isoformat(), "peers": {}}
    try:
        # What TCP's congestion control is decides the tails across hosts
        # (BBR and cubic differ on shaped links): every table says which.
        meta["tcp_congestion_control"] = sh(
            "ip", "netns", "exec", f"{name}-h0", "cat", "/proc/sys/net/ipv4/tcp_congestion_control",
            check=False).stdout.strip() or "unknown"
        nominal = rate_bytes(a.rate)
        goodput = tcp_goodput(name)
        meta["link_nominal_Bps"], meta["link_tcp_Bps"] = nominal, goodput
        print(f"link: nominal {nominal / 1e9:.4f} GB/s, one TCP stream {goodput / 1e9:.4f} GB/s "
              f"({goodput / nominal:.1%})", flush=True)
        for peer in a.peers.split(","):
            out = os.path.join(a.outdir, f"cluster-{peer}.jsonl")
            if os.path.exists(out):
                os.unlink(out)
            t0 = time.monotonic()
            try:
                meta["peers"][peer] = run_peer(peer, a, name, out)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"{peer}: failed: {str(e)[-1500:]}", flush=True)
                continue
            for line in open(out):
                r = json.loads(line)
                if r["op"] in TIMED:
                    r["busbw_Bps"] = None
                else:
                    r["busbw_Bps"] = busbw(r["op"], r["bytes"], r["t_med_s"], n)
                    r["of_nominal"] = r["busbw_Bps"] / link_bound(r["op"], nominal, a.hosts, n)
                    r["of_tcp"] = r["busbw_Bps"] / link_bound(r["op"], goodput, a.hosts, n)
                r["peer"] = peer
                records.append(r)
            print(f"{peer}: {time.monotonic() - t0:.0f} s", flush=True)
    finally:
        cluster("down", "--name", name, check=False)
    stamp = datetime.date.today().isoformat()
    base = os.path.join(a.outdir, f"cluster-{stamp}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)
    md = table(records, meta, a, n)
    with open(base + ".md", "w") as f:
        f.write(md)
    print(md)
    chart(records, meta, a, n, base + ".png")


def table(records, meta, a, n):
    peers = [p for p in a.peers.split(",") if any(r["peer"] == p for r in records)]
    lines = [
        f"### {a.hosts} hosts x {a.per_host} ranks, links {a.rate} ({meta['date']})",
        "",
        f"TCP congestion control: {meta.get('tcp_congestion_control', 'unknown')}. "
        f"Link: nominal {meta['link_nominal_Bps'] / 1e9:.4f} GB/s; one bulk TCP stream "
        f"{meta['link_tcp_Bps'] / 1e9:.4f} GB/s. busbw in GB/s; in brackets, the fraction of "
        "the link-bound busbw (nominal / TCP stream). Barrier in ms; ping-pong (half the round "
        "trip) and ring exchange in us per operation.",
        "",
        "| op | size | " + " | ".join(peers) + " | rdist / best peer |",
        "|---|---|" + "---|" * (len(peers) + 1),
    ]
    order = ["allreduce", "allgather", "reduce_scatter", "broadcast", "barrier", "pingpong", "exchange"]
    keys = sorted({(r["op"], r["bytes"]) for r in records}, key=lambda k: (order.index(k[0]), k[1]))
    for op, nb in keys:
        cells, vals = [], {}
        for p in peers:
            r = next((r for r in records if r["peer"] == p and r["op"] == op and r["bytes"] == nb), None)
            if r is None:
                cells.append("-")
            elif op == "barrier":
                vals[p] = 1 / r["t_med_s"]
                cells.append(f"{r['t_med_s'] * 1e3:.2f}")
            elif op in TIMED:
                vals[p] = 1 / r["t_med_s"]
                cells.append(f"{r['t_med_s'] * 1e6:.1f} us")
            else:
                vals[p] = r["busbw_Bps"]
                cells.append(f"{r['busbw_Bps'] / 1e9:.4f} ({r['of_nominal']:.0%} / {r['of_tcp']:.0%})")
        others = [v for p, v in vals.items() if p != "rdist"]
        ratio = f"{vals['rdist'] / max(others):.2f}" if "rdist" in vals and others else "-"
        size = "" if op == "barrier" else fmt_size(nb) if nb else "0 B"
        lines.append(f"| {op} | {size} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def chart(records, meta, a, n, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("cluster_compare: no matplotlib; no chart")
        return
    ops = [op for op in ("allreduce", "allgather", "reduce_scatter", "broadcast")
           if any(r["op"] == op for r in records)]
    if not ops:
        return
    peers = [p for p in a.peers.split(",") if any(r["peer"] == p for r in records)]
    fig, axes = plt.subplots(1, len(ops), figsize=(4 * len(ops), 3.4), sharey=False, squeeze=False)
    for ax, op in zip(axes[0], ops):
        sizes = sorted({r["bytes"] for r in records if r["op"] == op})
        width = 0.8 / max(1, len(peers))
        for i, p in enumerate(peers):
            ys = [next((r["busbw_Bps"] / 1e9 for r in records
                        if r["peer"] == p and r["op"] == op and r["bytes"] == s), 0) for s in sizes]
            ax.bar([j + i * width for j in range(len(sizes))], ys, width, label=p)
        for bound, style in ((meta["link_nominal_Bps"], "-"), (meta["link_tcp_Bps"], "--")):
            ax.axhline(link_bound(op, bound, a.hosts, n) / 1e9, color="k", linestyle=style, lw=1)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [fmt_size(s) for s in sizes])
        ax.set_title(op)
        ax.set_ylabel("busbw GB/s")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=max(1, len(peers)), frameon=False)
    fig.suptitle(f"{a.hosts} hosts x {a.per_host} ranks, {a.rate} links "
                 "(line: link bound, dashed: TCP stream bound)", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    print(f"chart: {path}")


if __name__ == "__main__":
    main()
