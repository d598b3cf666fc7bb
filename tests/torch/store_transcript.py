"""Runs every TCPStore command through torch's own client against the store
at HOST:PORT and prints a transcript (one JSON line per step), so the
transcript against rdist's server can be compared with the one against
torch's server: torch is the reference.

usage: store_transcript.py HOST PORT
"""
import datetime
import json
import sys
import threading
import time

import torch.distributed as dist

host, port = sys.argv[1], int(sys.argv[2])


def client():
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=20))


store = client()
steps = []


def step(name, action):
    try:
        value = action()
    except Exception as e:  # the kind of failure is part of the transcript
        value = "raised " + type(e).__name__
    if isinstance(value, bytes):
        value = "bytes " + value.hex()
    if isinstance(value, list):
        value = [v.hex() if isinstance(v, bytes) else v for v in value]
    steps.append(name)
    print(json.dumps({"step": name, "value": value}), flush=True)


short = datetime.timedelta(milliseconds=300)
step("set", lambda: store.set("a", "1"))
step("get", lambda: store.get("a"))
step("set empty", lambda: store.set("empty", b""))
step("get empty", lambda: store.get("empty"))
step("set binary", lambda: store.set("bin", bytes(range(256))))
step("get binary", lambda: store.get("bin"))
step("add new", lambda: store.add("n", 5))
step("add more", lambda: store.add("n", -7))
step("get counter", lambda: store.get("n"))
step("compare_set missing, empty expected", lambda: store.compare_set("cs", "", "first"))
step("compare_set wrong expected", lambda: store.compare_set("cs", "nope", "x"))
step("compare_set right expected", lambda: store.compare_set("cs", "first", "second"))
step("compare_set missing, other expected", lambda: store.compare_set("cs2", "old", "x"))
step("check present", lambda: store.check(["a", "n"]))
step("check missing", lambda: store.check(["a", "cs2"]))
step("wait present", lambda: store.wait(["a", "n"]))
step("wait times out", lambda: store.wait(["never"], short))
step("still usable after a timeout", lambda: store.get("a"))
step("get times out", lambda: (store.set_timeout(short), store.get("never"))[1])
store.set_timeout(datetime.timedelta(seconds=20))


def set_later():
    time.sleep(0.3)
    client().set("late", "here")


threading.Thread(target=set_later).start()
step("wait woken by another client", lambda: store.wait(["late"]))
step("get what another client set", lambda: store.get("late"))
step("append new", lambda: store.append("log", "ab"))
step("append more", lambda: store.append("log", "cd"))
step("get appended", lambda: store.get("log"))
step("multi_set", lambda: store.multi_set(["m1", "m2", "m3"], ["one", "", "three"]))
step("multi_get", lambda: store.multi_get(["m3", "m1", "m2"]))
step("num_keys", lambda: store.num_keys())
step("delete_key present", lambda: store.delete_key("m1"))
step("delete_key absent", lambda: store.delete_key("m1"))
step("num_keys after delete", lambda: store.num_keys())
step("list_keys", lambda: sorted(store.list_keys()))
step("queue_push", lambda: (store.queue_push("q", "x"), store.queue_push("q", "y")))
step("queue_len", lambda: store.queue_len("q"))
step("check a queue", lambda: store.check(["q"]))
step("queue_pop", lambda: store.queue_pop("q"))
step("queue_pop again", lambda: store.queue_pop("q", False))
step("queue_pop empty", lambda: store.queue_pop("q", False))


def barrier_peer():
    client().barrier("bar", 2, datetime.timedelta(seconds=10))


peer = threading.Thread(target=barrier_peer)
peer.start()
step("barrier of 2", lambda: store.barrier("bar", 2, datetime.timedelta(seconds=10)))
peer.join()
step("barrier times out", lambda: store.barrier("bar2", 2, short))
prefixed = dist.PrefixStore("pre", store)
step("prefix store set", lambda: prefixed.set("k", "v"))
step("prefix store key", lambda: store.get("pre/k"))
step("ping after everything", lambda: store.check(["a"]))
print(json.dumps({"done": len(steps)}), flush=True)
