"""Drives the embedded Consul-compatible server with the real py-consul client.

Usage: python py_consul_check.py HOST PORT. Exits non-zero (with a traceback) on any mismatch.
"""

import base64
import sys
import threading
import time

import consul


def main(host: str, port: int) -> None:
    c = consul.Consul(host=host, port=port)

    # KV: put, get, flags, cas, keys, recurse, delete.
    assert c.kv.put("py/a", "1") is True
    assert c.kv.put("py/b", "2", flags=7) is True
    index, item = c.kv.get("py/a")
    assert item["Value"] == b"1", item
    assert int(index) >= 1
    _, b = c.kv.get("py/b")
    assert b["Flags"] == 7, b
    assert c.kv.put("py/a", "x", cas=0) is False, "cas=0 on an existing key"
    assert c.kv.put("py/a", "3", cas=item["ModifyIndex"]) is True
    _, keys = c.kv.get("py/", keys=True)
    assert keys == ["py/a", "py/b"], keys
    _, items = c.kv.get("py/", recurse=True)
    assert [i["Key"] for i in items] == ["py/a", "py/b"], items
    index, missing = c.kv.get("py/missing")
    assert missing is None and int(index) >= 1
    assert c.kv.delete("py/b") is True
    _, gone = c.kv.get("py/b")
    assert gone is None

    # Sessions and locks.
    sid = c.session.create(name="py-session", ttl=10, behavior="delete", lock_delay=0)
    _, info = c.session.info(sid)
    assert info["Name"] == "py-session" and info["Behavior"] == "delete" and info["TTL"] == "10s", info
    renewed = c.session.renew(sid)
    assert renewed["ID"] == sid, renewed
    _, sessions = c.session.list()
    assert sid in [s["ID"] for s in sessions], sessions
    assert c.kv.put("py/lock", "me", acquire=sid) is True
    other = c.session.create(name="other")
    assert c.kv.put("py/lock", "them", acquire=other) is False
    _, lock = c.kv.get("py/lock")
    assert lock["Session"] == sid and lock["LockIndex"] == 1, lock
    assert c.kv.put("py/lock", "free", release=sid) is True
    _, lock = c.kv.get("py/lock")
    assert "Session" not in lock or not lock["Session"], lock
    assert c.kv.put("py/eph", "e", acquire=sid) is True
    assert c.session.destroy(sid) is True
    _, eph = c.kv.get("py/eph")
    assert eph is None, "delete behavior removes held keys"
    c.session.destroy(other)

    # A blocking get wakes when the key changes.
    index, item = c.kv.get("py/a")

    def later():
        time.sleep(0.5)
        c.kv.put("py/a", "changed")

    t = threading.Thread(target=later)
    started = time.time()
    t.start()
    new_index, item = c.kv.get("py/a", index=index, wait="20s")
    t.join()
    assert item["Value"] == b"changed", item
    assert int(new_index) > int(index)
    assert time.time() - started < 10, "woke on the change"

    # A blocking get times out with the same index.
    started = time.time()
    same_index, _ = c.kv.get("py/a", index=new_index, wait="300ms")
    assert same_index == new_index
    assert time.time() - started >= 0.3

    # Transactions: commit and rollback.
    enc = lambda s: base64.b64encode(s.encode()).decode()
    r = c.txn.put([
        {"KV": {"Verb": "set", "Key": "py/t1", "Value": enc("one")}},
        {"KV": {"Verb": "cas", "Key": "py/t2", "Value": enc("two"), "Index": 0}},
        {"KV": {"Verb": "get", "Key": "py/t1"}},
    ])
    assert r["Errors"] is None and len(r["Results"]) == 3, r
    assert base64.b64decode(r["Results"][2]["KV"]["Value"]) == b"one", r
    try:
        c.txn.put([
            {"KV": {"Verb": "set", "Key": "py/t3", "Value": enc("three")}},
            {"KV": {"Verb": "check-not-exists", "Key": "py/t1"}},
        ])
        raise AssertionError("a failing transaction must raise")
    except consul.ConsulException as e:
        assert "exists" in str(e), e
    _, t3 = c.kv.get("py/t3")
    assert t3 is None, "rolled back"

    print("py-consul interop: all checks passed")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
