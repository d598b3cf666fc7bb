#!/usr/bin/env python3
"""Delays every packet of a netfilter queue (iptables NFQUEUE) by a fixed time, for kernels
without netem (scripts/cluster.sh starts one per host, in the host's
network namespace, behind `queue num Q` in that host's input chain).

The kernel's nfnetlink_queue speaks netlink; this talks it with the
standard library alone. Packets are held by the kernel: only their ids
come here (copy mode META), and they are released in arrival order with
one batch verdict ("accept every id up to N"). Should this fall behind
(the queue holds 65536 packets), the kernel lets packets through
undelayed (fail-open) rather than dropping them.

    link_delay.py --queue Q --delay-ms D [--ready FILE]

FILE is created once the queue is bound (cluster.sh waits for it before
steering packets here: packets queued with nobody bound would be dropped).
"""

import argparse
import collections
import errno
import os
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_CONFIG = 2
NFQNL_MSG_VERDICT_BATCH = 3
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_CFG_QUEUE_MAXLEN = 3
NFQA_CFG_MASK = 4
NFQA_CFG_FLAGS = 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_FAIL_OPEN = 1
NF_ACCEPT = 1
NLM_F_REQUEST = 1
NLM_F_ACK = 4
NLMSG_ERROR = 2
SO_RCVBUFFORCE = 33


def attr(kind, payload):
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * ((4 - length % 4) % 4)


class Queue:
    def __init__(self, number):
        self.number = number
        self.seq = 0
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20)
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        self.sock.bind((0, 0))
        self.buf = bytearray(1 << 20)

    def send(self, msg_type, attrs, ack=False):
        self.seq += 1
        body = struct.pack("!BBH", socket.AF_UNSPEC, 0, self.number) + b"".join(attrs)
        flags = NLM_F_REQUEST | (NLM_F_ACK if ack else 0)
        header = struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg_type, flags, self.seq, 0)
        self.sock.send(header + body)
        if ack:
            reply = self.sock.recv(65536)
            _, kind, _, _, _ = struct.unpack_from("=IHHII", reply)
            code = struct.unpack_from("=i", reply, 16)[0] if kind == NLMSG_ERROR else 0
            if code != 0:
                raise OSError(-code, f"nfnetlink_queue config: {os.strerror(-code)}")

    def bind(self):
        self.send(NFQNL_MSG_CONFIG, [attr(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_BIND, 0, 0))], ack=True)
        self.send(NFQNL_MSG_CONFIG, [attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))], ack=True)
        self.send(NFQNL_MSG_CONFIG, [attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", 1 << 16))], ack=True)
        # A full queue lets packets through undelayed rather than dropping
        # them: loss is what --loss asks for, not a side effect of delay.
        self.send(
            NFQNL_MSG_CONFIG,
            [attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_FAIL_OPEN)), attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_FAIL_OPEN))],
            ack=True,
        )

    def packet_ids(self):
        """The ids of every packet notice waiting on the socket."""
        ids = []
        while True:
            try:
                n = self.sock.recv_into(self.buf, len(self.buf), socket.MSG_DONTWAIT)
            except BlockingIOError:
                return ids
            except OSError as e:
                # Notices the socket could not take: the kernel let those
                # packets through (fail-open); go on with the rest.
                if e.errno == errno.ENOBUFS:
                    continue
                raise
            self.parse(memoryview(self.buf)[:n], ids)

    @staticmethod
    def parse(data, ids):
        offset = 0
        while offset + 16 <= len(data):
            length, kind, _, _, _ = struct.unpack_from("=IHHII", data, offset)
            if length < 16:
                break
            if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                at = offset + 20  # nlmsghdr + nfgenmsg
                end = offset + length
                while at + 4 <= end:
                    alen, atype = struct.unpack_from("=HH", data, at)
                    if alen < 4:
                        break
                    if atype & 0x3FFF == NFQA_PACKET_HDR:
                        ids.append(struct.unpack_from("!I", data, at + 4)[0])
                        break
                    at += (alen + 3) & ~3
            offset += (length + 3) & ~3

    def accept_through(self, packet_id):
        self.send(NFQNL_MSG_VERDICT_BATCH, [attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id))])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queue", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--ready")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    queue = Queue(args.queue)
    queue.bind()
    if args.ready:
        with open(args.ready, "w") as f:
            f.write(f"{os.getpid()}\n")
    delay = args.delay_ms / 1000.0
    held = collections.deque()  # (due, id), in arrival order
    while True:
        wait = max(0.0, held[0][0] - time.monotonic()) if held else None
        readable, _, _ = select.select([queue.sock], [], [], wait)
        if readable:
            now = time.monotonic()
            for packet_id in queue.packet_ids():
                held.append((now + delay, packet_id))
        now = time.monotonic()
        last = None
        while held and held[0][0] <= now:
            last = held.popleft()[1]
        if last is not None:
            queue.accept_through(last)


if __name__ == "__main__":
    main()
