"""Scale-out (`serve --replicas N --ray-address local`): the routing policy on its own, then
two replicas of the tiny model on a local Ray cluster behind the ingress (skipped without
the `ray` extra): sticky sessions, prefix affinity of re-sent conversations, bounded load
under a skewed workload, a replica killed mid-workload, a replica drained."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvsession import ConfigError
from kvsession.serve.conversations import conversation_keys
from kvsession.serve.router import (
    Decision,
    Kind,
    Reason,
    ReplicaRouter,
    ReplicaState,
    Routing,
)

SYSTEM = {"role": "system", "content": "You are a careful agent. " * 8}


def convo(i: int, turns: int = 1) -> list[dict]:
    msgs = [SYSTEM]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"conversation {i} turn {t}"})
        if t < turns - 1:
            msgs.append({"role": "assistant", "content": f"reply {i}.{t}"})
    return msgs


def keys_of(messages):
    return conversation_keys(messages)[1:]


def ready_router(n: int = 2) -> ReplicaRouter:
    r = ReplicaRouter([f"replica-{i}" for i in range(n)])
    for name in r.names:
        r.set_state(name, ReplicaState.READY)
    return r


def test_the_conversation_key_is_the_one_a_replica_files():
    # the key of a request's messages + the reply is the next request's key at that depth,
    # whatever shape the client echoes the reply back in
    turn1 = convo(0)
    reply = {"role": "assistant", "content": "reply 0.0"}
    echoed = {"role": "assistant", "content": [{"type": "text", "text": "reply 0.0"}],
              "refusal": None}
    turn2 = [*turn1, echoed, {"role": "user", "content": "more"}]
    assert conversation_keys([*turn1, reply])[-1] == conversation_keys(turn2)[len(turn1) + 1]
    assert conversation_keys(turn1, tools=[{"type": "function"}])[1] != \
        conversation_keys(turn1)[1]


def test_a_conversation_returns_to_the_replica_that_answered_it():
    r = ready_router()
    d = r.route_conversation(keys_of(convo(0)))
    assert d.kind is Kind.CONVERSATION_NEW
    r.started(d)
    r.finished(d)
    r.served(d.replica, keys_of(convo(0)))
    follow_up = keys_of(convo(0, turns=2))
    d2 = r.route_conversation(follow_up)
    assert d2 == Decision(d.replica, Kind.CONVERSATION_AFFINE, len(keys_of(convo(0))))


def test_a_summary_teaches_a_filed_conversation_deeper_than_any_answered_prefix():
    r = ready_router()
    follow_up = keys_of(convo(3, turns=3))
    # replica-1 reports a Session filed under the conversation's first 4 messages (an
    # ingress that restarted knows nothing else); replica-0 answered its system prompt
    r.served("replica-0", follow_up[:1])
    r.report("replica-1", {follow_up[3]}, [])
    assert r.depths(follow_up) == {"replica-0": 1, "replica-1": 4}
    assert r.route_conversation(follow_up).replica == "replica-1"
    r.report("replica-1", set(), [])  # evicted there
    assert r.depths(follow_up)["replica-1"] == 0


def test_eight_new_conversations_sharing_a_system_prompt_split_at_the_fair_share():
    r = ready_router()
    r.served("replica-0", keys_of(convo(99)))  # the system prompt's affinity: replica-0
    placed = []
    for i in range(8):
        cap = r.cap()
        d = r.route_conversation(keys_of(convo(i)))
        assert r.load[d.replica] < cap  # taking it keeps the replica within its cap
        r.started(d)
        placed.append(d)
    # not 5/3 (the 1.25x bound): each conversation's history will live where it starts
    assert r.load == {"replica-0": 4, "replica-1": 4}
    assert [d.replica for d in placed] == ["replica-0", "replica-1"] * 4
    assert {d.kind for d in placed} == {Kind.CONVERSATION_AFFINE, Kind.CONVERSATION_SPILLED}
    # a follow-up (a continued history) stays put under the 1.25x bound: with 5 + 4 in
    # flight a new conversation no longer fits replica-0 (fair cap 5), this one does (7)
    r.served("replica-0", keys_of(convo(0)))
    r.load["replica-0"] += 1
    assert r.route_conversation(keys_of(convo(8))).replica == "replica-1"
    follow = r.route_conversation(keys_of(convo(0, turns=2)))
    assert follow.kind is Kind.CONVERSATION_AFFINE and follow.replica == "replica-0"


def test_eight_new_sessions_split_at_the_fair_share():
    r = ready_router()
    for i in range(8):
        d = r.route_session(f"s{i}")
        assert d.kind is Kind.SESSION_NEW
        r.started(d, f"s{i}")
    assert r.load == {"replica-0": 4, "replica-1": 4}


def test_a_continued_conversation_stays_unless_its_replica_is_full_while_another_idles():
    r = ready_router()
    r.served("replica-0", keys_of(convo(1)))
    follow_up = keys_of(convo(1, turns=2))
    r.load.update({"replica-0": 4, "replica-1": 1})  # over the cap (3), nobody idle
    assert r.route_conversation(follow_up) == Decision(
        "replica-0", Kind.CONVERSATION_AFFINE, len(keys_of(convo(1))))
    r.load["replica-1"] = 0  # now one idles: the bound wins
    assert r.route_conversation(follow_up).kind is Kind.CONVERSATION_SPILLED
    # a new conversation sharing only the system prompt spills at the cap already
    r.load["replica-1"] = 1
    assert r.route_conversation(keys_of(convo(2))).replica == "replica-1"


def test_random_routing_is_the_seeded_baseline():
    r = ReplicaRouter(["replica-0", "replica-1"], routing=Routing.RANDOM, seed=3)
    for name in r.names:
        r.set_state(name, ReplicaState.READY)
    r.served("replica-0", keys_of(convo(0)))
    got = [r.route_conversation(keys_of(convo(0, turns=2))) for _ in range(20)]
    assert {d.kind for d in got} == {Kind.RANDOM}
    assert {d.replica for d in got} == {"replica-0", "replica-1"}
    d = r.route_session("s")  # sessions stay sticky
    r.started(d, "s")
    assert {r.route_session("s").replica for _ in range(5)} == {d.replica}
    with pytest.raises(ConfigError, match="routing"):
        ReplicaRouter(["a"], routing="random")


def test_sessions_are_sticky_and_move_when_their_replica_is_lost():
    r = ready_router()
    d = r.route_session("agent-7")
    assert d.kind is Kind.SESSION_NEW
    r.started(d, "agent-7")
    r.finished(d, "agent-7")
    assert r.route_session("agent-7") == Decision(d.replica, Kind.SESSION_STICKY)
    other = next(n for n in r.names if n != d.replica)
    r.set_state(d.replica, ReplicaState.DEAD)
    r.lost(d.replica, Reason.DEAD)
    moved = r.route_session("agent-7")
    assert moved == Decision(other, Kind.SESSION_MIGRATED, moved_from=d.replica,
                             reason=Reason.DEAD)
    r.started(moved, "agent-7")
    r.finished(moved, "agent-7")
    # the dead replica restarts empty: the session stays where it went
    r.set_state(d.replica, ReplicaState.READY)
    assert r.route_session("agent-7").replica == other
    assert r.migrations[Reason.DEAD] == 1


def test_a_draining_replica_keeps_its_sessions_until_it_stops():
    r = ready_router()
    d = r.route_session("s")
    r.started(d, "s")
    r.finished(d, "s")
    r.set_state(d.replica, ReplicaState.DRAINING)
    assert r.route_session("s").kind is Kind.SESSION_STICKY  # its lock is still there
    assert r.route_session("new").replica != d.replica  # new work goes elsewhere
    r.set_state(d.replica, ReplicaState.STOPPING)
    assert r.waiting_on("s") == d.replica
    r.lost(d.replica, Reason.DRAINED)
    r.set_state(d.replica, ReplicaState.GONE)
    assert r.waiting_on("s") is None
    moved = r.route_session("s")
    assert (moved.kind, moved.reason) == (Kind.SESSION_MIGRATED, Reason.DRAINED)


def test_an_idle_session_leaves_an_overloaded_replica_for_an_idle_one():
    r = ready_router()
    d = r.route_session("s")
    r.started(d, "s")
    r.finished(d, "s")
    other = next(n for n in r.names if n != d.replica)
    r.load[d.replica] = 3  # other requests in flight there, none on `other`
    moved = r.route_session("s")
    assert moved == Decision(other, Kind.SESSION_MIGRATED, moved_from=d.replica,
                             reason=Reason.OVERLOADED)
    # the old replica refused to let it go (a turn was running): it stays
    assert r.stay("s", moved) == Decision(d.replica, Kind.SESSION_STICKY)
    assert r.migrations[Reason.OVERLOADED] == 0
    r.load[other] = 1  # nobody idle: no move, however loaded
    assert r.route_session("s").kind is Kind.SESSION_STICKY


def test_a_summary_names_the_lock_holder():
    r = ready_router()
    r.report("replica-1", set(), ["resumed-elsewhere"])
    assert r.route_session("resumed-elsewhere").replica == "replica-1"
    assert r.sessions_on("replica-1") == 1


def test_a_refused_session_follows_the_summary_once_released():
    """What the ingress does on a 409 session_locked (the session is open on another
    replica than the router guessed): it releases the request's hold, then asks every
    replica for its summary. A summary does not move a session a request still holds (a
    stale one could), so the release comes first; then the retry goes to the holder."""
    r = ready_router()
    d = r.route_session("guessed-wrong")
    holder = next(n for n in r.names if n != d.replica)
    r.started(d, "guessed-wrong")
    r.report(holder, set(), ["guessed-wrong"])
    assert r.route_session("guessed-wrong").replica == d.replica  # held: not moved
    r.finished(d, "guessed-wrong")
    r.report(holder, set(), ["guessed-wrong"])
    assert r.route_session("guessed-wrong").replica == holder


def test_no_ready_replica_and_bad_arguments():
    r = ReplicaRouter(["a", "b"])
    assert r.route_session("s") is None and r.route_conversation([b"k"]) is None
    with pytest.raises(ConfigError, match="replica"):
        r.set_state("c", ReplicaState.READY)
    with pytest.raises(ConfigError, match="targets"):
        ReplicaRouter([])
    with pytest.raises(ConfigError, match="load_bound"):
        ReplicaRouter(["a"], load_bound=0.5)


# ---- two replicas on a local Ray cluster ---------------------------------------------------

ENGINE = ["--device", "cpu", "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
          "--host-cache-memory", "0"]
PROMPT = "You are a coding agent working in a small repository. " * 2


def test_a_connect_error_of_the_ingress_itself_blames_no_replica(tmp_path):
    """A connect that fails because the ingress is out of file descriptors is the
    ingress's (503, nothing restarted), while a refused connection is the replica's: told
    apart on real httpx errors, in a child process whose descriptor table is filled."""
    import subprocess
    import sys

    pytest.importorskip("httpx")
    script = tmp_path / "probe.py"
    script.write_text("""
import os, resource, socket
import httpx
from kvsession.serve.ray_ingress import ingress_side
listening = socket.socket()
listening.bind(("127.0.0.1", 0))
listening.listen()
free = socket.socket()
free.bind(("127.0.0.1", 0))
free_port = free.getsockname()[1]
free.close()
client = httpx.Client(timeout=5)

def connect_error(port):
    try:
        client.get(f"http://127.0.0.1:{port}/")
    except httpx.ConnectError as e:
        return e

refused = connect_error(free_port)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
fds = []
try:
    while True:
        fds.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
full = connect_error(listening.getsockname()[1])
for fd in fds:
    os.close(fd)
print(type(refused).__name__, ingress_side(refused), type(full).__name__, ingress_side(full))
""")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split() == ["ConnectError", "False", "ConnectError", "True"], out.stderr


@pytest.mark.parametrize("flag", ["--replica-unresponsive-s", "--request-timeout-s",
                                  "--summary-interval-s"])
@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_replica_timing_flags_must_be_positive_and_finite(flag, value, capsys):
    """Refused before Ray or the model is touched: a usage error naming the flag."""
    import argparse

    from kvsession.serve.ray_main import _check, add_replica_arguments

    p = argparse.ArgumentParser()
    add_replica_arguments(p)
    p.add_argument("--session-dir")
    args = p.parse_args(["--replicas", "2", flag, value])
    with pytest.raises(SystemExit):
        _check(p, args)
    assert f"{flag} must be > 0 and finite" in capsys.readouterr().err


def _needs_ray():
    for module, extra in (("ray", "ray"), ("httpx", "ray"), ("starlette", "server"),
                          ("uvicorn", "server")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install 'kvsession[{extra}]')")


class Cluster:
    """The ingress subprocess (`serve --replicas 2 --ray-address local`) and raw HTTP."""

    def __init__(self, model: Path, tmp: Path):
        from kvsession.serve.process import ServerProcess
        self.proc = ServerProcess(
            model, *ENGINE, "--replicas", "2", "--ray-address", "local", "--ray-num-cpus", "2",
            "--session-dir", str(tmp / "sessions"), "--summary-interval-s", "0.2",
            "--replica-unresponsive-s", "15",
            stderr_path=tmp / "ingress.stderr", start_timeout_s=300)
        self.url = self.proc.url
        self.model = model.name

    def request(self, method: str, path: str, body: dict | None = None,
                timeout: float = 60) -> tuple[int, dict, dict]:
        req = urllib.request.Request(f"{self.url}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, dict(r.headers), json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), json.loads(e.read() or b"{}")

    def chat(self, messages: list[dict], session_id: str | None = None, **kw) -> tuple[str, dict]:
        """(replica, response) of a greedy chat request; fails on any status but 200."""
        body = {"model": self.model, "messages": messages, "max_tokens": 8, "temperature": 0,
                **kw}
        if session_id is not None:
            body["session_id"] = session_id
        status, headers, r = self.request("POST", "/v1/chat/completions", body)
        assert status == 200, (status, r, self.proc.stderr_tail())
        return headers["x-kvsession-replica"], r

    def health(self) -> dict:
        return self.request("GET", "/health")[2]

    def metric(self, name: str, **labels) -> float:
        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=10).read().decode()
        lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
        m = re.search(rf"^{name}{'{' + lab + '}' if lab else ''} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def wait_ready(self, n: int = 2, timeout: float = 90.0) -> dict:
        """Both replicas ready (a test may leave one restarting)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            h = self.health()
            if h.get("ready") == n:
                return h
            time.sleep(0.1)
        raise AssertionError(f"replicas not ready in {timeout} s: {self.health()}")

    def replica(self, name: str) -> dict:
        """The ingress's view of one replica (state, pid, requests in flight)."""
        return next(r for r in self.health()["replicas"] if r["name"] == name)

    def wait_for(self, pred, what: str, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}: {self.health()}")


@pytest.fixture(scope="module")
def cluster(model_dirs, tmp_path_factory):
    _needs_ray()
    c = Cluster(model_dirs("llama"), tmp_path_factory.mktemp("scale-out"))
    yield c
    assert c.proc.stop(timeout=90) == 0, c.proc.stderr_tail()


@pytest.fixture(scope="module")
def reference(model_dirs):
    """The same model in this process: the oracle for every session's replies."""
    _needs_ray()
    from kvsession import LLM
    with LLM(model_dirs("llama"), device="cpu", kv_cache_memory="64MiB", max_model_len=1024,
             host_cache_memory=0) as llm:
        yield llm


def reference_replies(llm, users: list[str], max_tokens: int = 8) -> list[str]:
    from kvsession import SamplingParams
    s = llm.session(system=PROMPT, sampling=SamplingParams(max_tokens=max_tokens,
                                                           temperature=0.0))
    try:
        return [s.send(u).text for u in users]
    finally:
        s.close()


def user(sid: str, turn: int) -> str:
    return f"{sid}: step {turn}, open the next file"


def run_turns(cluster, sid: str, history: list[dict], turns: range) -> list[tuple[str, dict]]:
    out = []
    for t in turns:
        history.append({"role": "user", "content": user(sid, t)})
        replica, r = cluster.chat(history, session_id=sid)
        history.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
        out.append((replica, r))
    return out


def test_sticky_sessions_report_cached_tokens(cluster):
    cluster.wait_ready()
    for sid in ("sticky-a", "sticky-b", "sticky-c"):
        history = [{"role": "system", "content": PROMPT}]
        served = run_turns(cluster, sid, history, range(4))
        assert len({replica for replica, _ in served}) == 1, served
        for (_, prev), (_, r) in zip(served, served[1:], strict=False):
            before = prev["usage"]["prompt_tokens"] + prev["usage"]["completion_tokens"]
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * before
    assert cluster.metric("kvsession_router_decisions_total", kind="session_sticky") >= 9


def openai_client(cluster):
    """The official client pointed at the ingress, once the cluster serves."""
    openai = pytest.importorskip("openai")
    cluster.wait_ready()
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def test_resent_conversations_return_to_the_replica_holding_them(cluster):
    client = openai_client(cluster)
    msgs = [{"role": "system", "content": PROMPT + " Stateless client."},
            {"role": "user", "content": "list the files"}]
    replicas, history = [], 0
    for turn in range(4):
        raw = client.chat.completions.with_raw_response.create(
            model=cluster.model, messages=msgs, max_tokens=8, temperature=0)
        r = raw.parse()
        replicas.append(raw.headers["x-kvsession-replica"])
        if turn:  # the replica's conversation table continued the Session: all reused
            assert r.usage.prompt_tokens_details.cached_tokens >= 0.9 * history
        history = r.usage.prompt_tokens + r.usage.completion_tokens
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": f"now run step {turn}"}]
    assert len(set(replicas)) == 1, replicas
    assert cluster.metric("kvsession_router_decisions_total", kind="conversation_affine") >= 3


def test_responses_chains_and_anthropic_conversations_stay_on_their_replica(cluster):
    """Through the ingress: a chain of Responses (previous_response_id) goes to its chain's
    Session on one replica, each turn served from its KV; GET finds a stored response
    there; an Anthropic conversation re-sent each turn returns to the replica holding it."""
    client = openai_client(cluster)
    anthropic = pytest.importorskip("anthropic")
    replicas, prev, history = [], None, 0
    for turn in range(4):
        raw = client.responses.with_raw_response.create(
            model=cluster.model, input=f"step {turn}: open the next file", instructions=PROMPT,
            previous_response_id=prev, max_output_tokens=8, temperature=0)
        r = raw.parse()
        replicas.append(raw.headers["x-kvsession-replica"])
        if turn:
            assert r.usage.input_tokens_details.cached_tokens >= history - 1
        history = r.usage.input_tokens + r.usage.output_tokens
        prev = r.id
    assert len(set(replicas)) == 1, replicas
    assert client.responses.retrieve(prev).id == prev
    ac = anthropic.Anthropic(base_url=cluster.url, api_key="unused", max_retries=0, timeout=60)
    msgs, replicas = [{"role": "user", "content": "Anthropic client: list the files"}], []
    for turn in range(3):
        raw = ac.messages.with_raw_response.create(model=cluster.model, max_tokens=8,
                                                   system=PROMPT, messages=msgs,
                                                   extra_body={"temperature": 0})
        m = raw.parse()
        replicas.append(raw.headers["x-kvsession-replica"])
        if turn:
            assert m.usage.cache_read_input_tokens > 0
        msgs += [{"role": "assistant", "content": m.content[0].text},
                 {"role": "user", "content": f"then step {turn}"}]
    assert len(set(replicas)) == 1, replicas


def test_streams_models_and_errors_pass_through(cluster):
    client = openai_client(cluster)
    msgs = [{"role": "system", "content": PROMPT}, {"role": "user", "content": "stream it"}]
    whole = client.chat.completions.create(model=cluster.model, messages=msgs, max_tokens=12,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model=cluster.model, messages=msgs, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [m.id for m in client.models.list().data] == [cluster.model]
    with pytest.raises(pytest.importorskip("openai").NotFoundError):  # the error JSON, relayed
        client.chat.completions.create(model="no-such-model", messages=msgs, max_tokens=2)
    # the ingress's own errors are OpenAI's JSON too, and a body it cannot key (a lone
    # surrogate) still reaches a replica, which answers its 400
    for method, path, body, status in (
            ("GET", "/v1/nothing", None, 404), ("GET", "/v1/chat/completions", None, 405),
            ("POST", "/v1/chat/completions", {"model": cluster.model, "messages": [
                {"role": "user", "content": "\ud800"}]}, 400)):
        got, _, answer = cluster.request(method, path, body)  # JSON, or it raises
        assert got == status and {"message", "type"} <= set(answer["error"]), answer
    text = client.completions.create(model=cluster.model, prompt="the agent reads",
                                     max_tokens=4, temperature=0).choices[0].text
    assert isinstance(text, str)


def test_a_skewed_workload_spreads_within_the_load_bound(cluster):
    cluster.wait_ready()
    system = {"role": "system", "content": PROMPT + " Shared by eight."}
    start = threading.Barrier(8, timeout=60)

    def first_turn(i: int):
        msgs = [system, {"role": "user", "content": f"conversation {i}: read the file"}]
        start.wait()
        # long enough that all eight are in flight together (the bound is about those)
        replica, r = cluster.chat(msgs, max_tokens=48, ignore_eos=True)
        return replica, msgs + [r["choices"][0]["message"]]

    with ThreadPoolExecutor(8) as pool:
        firsts = list(pool.map(first_turn, range(8)))
    counts = Counter(replica for replica, _ in firsts)
    # 8 in flight over 2 replicas: at most ceil(1.25 * 8 / 2) = 5 on one, not 8 / 0
    assert len(counts) == 2 and max(counts.values()) <= 5, counts
    # each conversation's next turn goes back to the replica that holds it
    for replica, msgs in firsts:
        again, _ = cluster.chat(msgs + [{"role": "user", "content": "and then?"}])
        assert again == replica


def test_a_killed_replica_s_sessions_continue_on_the_other(cluster, reference):
    cluster.wait_ready()
    sids = [f"kill-{i}" for i in range(6)]
    histories = {sid: [{"role": "system", "content": PROMPT}] for sid in sids}
    holder = {sid: run_turns(cluster, sid, histories[sid], range(2))[-1][0] for sid in sids}
    assert set(holder.values()) == {"replica-0", "replica-1"}, holder  # ids spread by hash
    victim = holder[sids[0]]
    pid = next(r["pid"] for r in cluster.health()["replicas"] if r["name"] == victim)
    os.kill(pid, signal.SIGKILL)
    # every session goes on at once (concurrently): the dead replica's from --session-dir
    with ThreadPoolExecutor(len(sids)) as pool:
        later = dict(zip(sids, pool.map(
            lambda sid: run_turns(cluster, sid, histories[sid], range(2, 4)), sids),
            strict=True))
    for sid in sids:
        got = [m["content"] for m in histories[sid] if m["role"] == "assistant"]
        # no acknowledged turn lost, identical tokens: the in-process reference agrees
        assert got == reference_replies(reference, [user(sid, t) for t in range(4)]), sid
        if holder[sid] == victim:
            assert {replica for replica, _ in later[sid]} == {
                next(n for n in ("replica-0", "replica-1") if n != victim)}
    moved = sum(1 for sid in sids if holder[sid] == victim)
    assert cluster.metric("kvsession_router_migrations_total", reason="dead") >= moved
    h = cluster.wait_ready()  # Ray restarted it: a new process
    assert next(r["pid"] for r in h["replicas"] if r["name"] == victim) != pid
    assert cluster.metric("kvsession_router_restarts_total", replica=victim) >= 1


def test_a_hung_replica_is_restarted_and_its_sessions_continue(cluster, reference):
    """A replica whose process is alive but answers nothing (SIGSTOP: a deadlock, a stuck
    device) is found by its missing summaries (--replica-unresponsive-s), killed and
    restarted by Ray; its sessions continue on the other replica with every turn."""
    cluster.wait_ready()
    sids = [f"hang-{i}" for i in range(4)]
    histories = {sid: [{"role": "system", "content": PROMPT}] for sid in sids}
    holder = {sid: run_turns(cluster, sid, histories[sid], range(2))[-1][0] for sid in sids}
    victim = holder[sids[0]]
    pid = cluster.replica(victim)["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        # a non-streamed request whose client leaves frees its place at once (its
        # connection to the replica is closed), long before the replica is found hung
        host, port = cluster.url.removeprefix("http://").split(":")
        body = json.dumps({"model": cluster.model, "max_tokens": 8, "session_id": sids[0],
                           "messages": [*histories[sids[0]], {"role": "user",
                                                              "content": "gone"}]}).encode()
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {len(body)}"
                         f"\r\n\r\n".encode() + body)
            cluster.wait_for(lambda: cluster.replica(victim)["in_flight"] == 1, "the relay")
        cluster.wait_for(lambda: cluster.replica(victim)["in_flight"] == 0, "its release",
                         timeout=8)
        assert (cluster.replica(victim)["state"], cluster.replica(victim)["pid"]) == \
            ("ready", pid)  # not yet found hung: released for its client, not the loss
        for sid in sids:  # the victim's first waits until it is found hung and killed
            run_turns(cluster, sid, histories[sid], range(2, 3))
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed by then, unless it failed
            os.kill(pid, signal.SIGCONT)
    for sid in sids:
        got = [m["content"] for m in histories[sid] if m["role"] == "assistant"]
        assert got == reference_replies(reference, [user(sid, t) for t in range(3)]), sid
    h = cluster.wait_ready()
    assert next(r["pid"] for r in h["replicas"] if r["name"] == victim) != pid
    assert "is hung" in cluster.proc.stderr_tail(20000)


def test_a_released_session_resumes_with_its_turns(cluster, reference):
    # what an overload move does first: the holder lets the idle session go (persisted,
    # lock released); whoever takes it next resumes every turn from --session-dir
    cluster.wait_ready()
    sid, history = "released-1", [{"role": "system", "content": PROMPT}]
    holder = run_turns(cluster, sid, history, range(2))[-1][0]
    url = next(r["url"] for r in cluster.health()["replicas"] if r["name"] == holder)
    req = urllib.request.Request(f"{url}/v1/kvsession/release", method="POST",
                                 data=json.dumps({"session_id": sid}).encode())
    assert json.loads(urllib.request.urlopen(req, timeout=60).read())["released"] is True
    run_turns(cluster, sid, history, range(2, 4))
    got = [m["content"] for m in history if m["role"] == "assistant"]
    assert got == reference_replies(reference, [user(sid, t) for t in range(4)])


def test_draining_a_replica_moves_its_sessions(cluster, reference):
    cluster.wait_ready()
    sids = [f"drain-{i}" for i in range(6)]
    histories = {sid: [{"role": "system", "content": PROMPT}] for sid in sids}
    holder = {sid: run_turns(cluster, sid, histories[sid], range(2))[-1][0] for sid in sids}
    victim = holder[sids[0]]
    before = cluster.metric("kvsession_router_migrations_total", reason="drained")
    status, _, body = cluster.request("POST", f"/admin/drain/{victim}", timeout=120)
    assert status == 200 and body["stopped_cleanly"], body
    ours = sum(1 for s in sids if holder[s] == victim)
    assert body["sessions_moved"] >= ours >= 1  # (other tests' sessions may be there too)
    for sid in sids:
        served = run_turns(cluster, sid, histories[sid], range(2, 3))
        if holder[sid] == victim:
            assert served[0][0] != victim
        got = [m["content"] for m in histories[sid] if m["role"] == "assistant"]
        assert got == reference_replies(reference, [user(sid, t) for t in range(3)]), sid
    assert cluster.metric("kvsession_router_migrations_total", reason="drained") - before == ours
    status, _, body = cluster.request("POST", "/admin/drain/replica-9")
    assert status == 404
    cluster.wait_ready()  # a fresh replica took the drained one's place


def test_a_replica_lost_while_draining_is_restarted_once(cluster):
    """The replica dies while a drain waits for its request in flight: its recovery (Ray
    restarting it) is left alone. Before, the drain went on to stop and kill the process Ray
    had just restarted (a second restart; with the restarts spent, the replica was dropped
    although the drain was asked to restart it)."""
    cluster.wait_ready()
    sid, history = "drain-lost-1", [{"role": "system", "content": PROMPT}]
    victim = run_turns(cluster, sid, history, range(1))[-1][0]
    pid = cluster.replica(victim)["pid"]
    before = cluster.metric("kvsession_router_restarts_total", replica=victim)
    os.kill(pid, signal.SIGSTOP)  # its request stays in flight: the drain waits for it
    out: dict = {}
    try:
        held = threading.Thread(target=lambda: out.update(turn=cluster.request(
            "POST", "/v1/chat/completions", {"model": cluster.model, "max_tokens": 4,
                                             "session_id": sid, "messages": [
                                                 *history, {"role": "user", "content": "x"}]},
            timeout=120)))
        held.start()
        cluster.wait_for(lambda: cluster.replica(victim)["in_flight"] == 1, "the request")
        drain = threading.Thread(target=lambda: out.update(drain=cluster.request(
            "POST", f"/admin/drain/{victim}", timeout=120)))
        drain.start()
        cluster.wait_for(lambda: cluster.replica(victim)["state"] == "draining", "the drain")
    finally:
        os.kill(pid, signal.SIGKILL)  # (a stopped process is killed all the same)
    drain.join(timeout=120)
    held.join(timeout=120)
    status, _, body = out["drain"]
    assert status == 200, body
    assert out["turn"][0] == 200, out["turn"]  # failed over to the other replica
    h = cluster.wait_ready()
    assert next(r["pid"] for r in h["replicas"] if r["name"] == victim) != pid
    assert cluster.metric("kvsession_router_restarts_total", replica=victim) == before + 1
    assert body["lost"] is True and body["restart"] is True, body
