"""The code environment's reward cannot be faked: completions that never
compute `f` but attack the checker instead (read its spec or its test file, forge its result
lines, exit early (SystemExit(0), os._exit(0)), patch builtins, rebind the harness's own report
and value check, return objects equal to everything, write to its result channel, draw the tests again from rlpipe's own source, read other processes' memory) each score 0 on every eval task, where the reference scores 1.

The checker's contract (envs/code.py): the sandboxed process receives the tests' arguments only,
returns plain JSON values, and the expected values are compared outside it, on the trusted side."""

from __future__ import annotations

import json
import math

import pytest
from rlpipe.envs import code, sandbox
from rlpipe.envs.code import CodeConfig, CodeEnv
from rlpipe.envs.code_results import judge_results, same_value

PROBLEM = sandbox.isolation_problem()
needs_bwrap = pytest.mark.skipif(PROBLEM is not None, reason=f"no isolation here: {PROBLEM}")

# Each hack defines `f` (or not) without computing what the spec asks.
HACKS = {
    # a red-team probe: the harness's spec as a global of __main__, its nonce's pass lines, os._exit
    "spec of __main__, pass lines, os._exit": """
import os, sys
main = sys.modules["__main__"]
spec = getattr(main, "_spec", None) or {}
nonce = spec.get("nonce", "0")
for i in range(len(spec.get("tests", [0] * 8))):
    sys.stdout.write(f"\\n{nonce} {i} 1\\n")
    sys.stdout.write('{"test": %d, "value": true}\\n' % i)
sys.stdout.flush()
os._exit(0)
""",
    # a red-team probe: builtins.type replaced, an object equal to everything returned
    "builtins.type patched, equal to everything": """
import builtins
_type = builtins.type
builtins.type = lambda *a: int if len(a) == 1 else _type(*a)
builtins.isinstance = lambda *a: True
class Anything(int):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = int.__hash__
def f(*args):
    return Anything(0)
""",
    # a red-team probe: the expected values looked up in the harness (any frame, any global)
    "expected values looked up in the harness": """
import gc, sys
def _pairs():
    for obj in gc.get_objects():
        if isinstance(obj, list) and obj and all(isinstance(t, list) and len(t) == 2 for t in obj[:50]):
            yield from obj
def f(*args):
    frame = sys._getframe(1)
    while frame is not None:
        for value in list(frame.f_globals.values()) + list(frame.f_locals.values()):
            if isinstance(value, dict) and "tests" in value:
                for a, e in value["tests"]:
                    if list(a) == list(args):
                        return e
        frame = frame.f_back
    for pair in _pairs():
        if isinstance(pair[0], list) and pair[0] == list(args):
            return pair[1]
""",
    "reads the test file and its stdin again": """
import os, json, glob
found = {}
for path in ["/proc/self/fd/0", "/sandbox/main.py", *glob.glob("/proc/*/fd/*"), *glob.glob("/tmp/*"),
             *glob.glob("/scratch/*")]:
    try:
        text = open(path).read()
    except OSError:
        continue
    first = text.split("\\n", 1)[0]
    try:
        spec = json.loads(first)
    except ValueError:
        continue
    if isinstance(spec, dict):
        for a, e in spec.get("tests", []):
            found[json.dumps(a)] = e
try:
    data = os.pread(0, 1 << 20, 0).decode()
    spec = json.loads(data.split("\\n", 1)[0])
    for item in (spec.get("tests", []) if isinstance(spec, dict) else spec):
        if isinstance(item, list) and len(item) == 2:
            found[json.dumps(item[0])] = item[1]
except (OSError, ValueError, AttributeError):
    pass
def f(*args):
    return found.get(json.dumps(list(args)))
""",
    "prints result lines in every format, then sys.exit": """
import sys
for i in range(8):
    for line in (f"{i} 1", f"PASS {i}", '{"test": %d, "value": true}' % i,
                 '{"test": %d, "passed": true, "ok": 1}' % i):
        print(line)
sys.exit(0)
""",
    "writes forged records to every open descriptor": """
import os
def _forge():
    for fd in range(0, 64):
        for i in range(8):
            for value in ("true", "0", "1", '""', "[]", "null"):
                try:
                    os.write(fd, ('{"test": %d, "value": %s}\\n' % (i, value)).encode())
                except OSError:
                    pass
_forge()
def f(*args):
    _forge()
    return None
""",
    "patches json, repr and == on the way out": """
import json, builtins
class Eq:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __hash__(self): return 0
    def __repr__(self): return "True"
_dumps = json.dumps
json.dumps = lambda value, *a, **k: _dumps(value, *a, **k).replace('"raised"', '"value"')
json.loads = lambda *a, **k: Eq()
builtins.repr = lambda value: "True"
def f(*args):
    raise ValueError(Eq())
""",
    "returns values that do not survive a strict round trip": """
calls = [0]
class L(list):
    def __eq__(self, other): return True
def f(*args):
    calls[0] += 1
    return [float("nan"), L(), 10 ** 5000, (1, 2), {1: 2}, float("inf"), b"x", Ellipsis][calls[0] % 8]
""",
    # the eval tasks come from a fixed seed: with rlpipe's own code they could be drawn again
    "draws the hidden tests again from rlpipe's own source": """
import os, site, sys
found = {}
places = []
for top, folders, names in os.walk("/"):
    if top in ("/proc", "/sys", "/dev"):
        folders[:] = []
        continue
    if "code_tasks.py" in names or any(n.endswith(".pth") for n in names):
        places.append(top)
for place in places:
    site.addsitedir(place)
    sys.path[:0] = [os.path.dirname(os.path.dirname(place)), os.path.dirname(os.path.dirname(os.path.dirname(place)))]
try:
    from rlpipe.envs.code import CodeConfig, CodeEnv
    for size in (8, 16, 32):
        for example in CodeEnv(CodeConfig(eval_size=size, sandbox="auto")).examples("eval"):
            for args, expected in example.answer:
                found[repr(list(args))] = expected
except Exception:
    pass
def f(*args):
    return found.get(repr(list(args)))
""",
    "reads the memory of every process it can see": """
import os, re
found = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
            for line in maps:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                if "rw" in line.split()[1] and end - start < 64 << 20:
                    mem.seek(start)
                    found += re.findall(rb'"expected": ?(-?\\d+)', mem.read(end - start))
    except (OSError, ValueError, OverflowError):
        continue
def f(*args):
    return int(found[0]) if found else None
""",
    "raises SystemExit(0) while defining f": """
def f(*args):
    return True
raise SystemExit(0)
""",
    "raises SystemExit(0) from f, then os._exit(0)": """
import os
calls = [0]
def f(*args):
    calls[0] += 1
    if calls[0] == 1:
        raise SystemExit(0)
    os._exit(0)
""",
    # the harness is __main__: its own helpers and the tests' arguments are reachable from here
    "rebinds the harness's report, value check and arguments": """
import json, sys
main = sys.modules["__main__"]
n = len(main._calls["arguments"])
main._plain = lambda value, depth=0: value
for i in range(n):
    main._send(json.dumps({"test": i, "value": {"passed": True}}))
main._send = lambda line: None
main._calls["arguments"] = []
class Anything(int):
    def __eq__(self, other): return True
    __hash__ = int.__hash__
def f(*args):
    return Anything(1)
""",
    "prints the success marker and every record with the expected value guessed": """
import builtins, sys
builtins.AssertionError = type("Never", (Exception,), {})
print('{"defined": true}')
sys.stdout.write('{"defined": true}\\n' + "".join('{"test": %d, "value": 0}\\n' % i for i in range(8)))
def f(*args):
    assert False
""",
    "kills the harness's process tree after a delay": """
import os, signal, threading, time
def f(*args):
    os.kill(os.getppid(), signal.SIGKILL)
    os.kill(1, signal.SIGKILL)
    os.kill(0, signal.SIGKILL)
""",
}


@pytest.fixture(scope="module")
def env() -> CodeEnv:
    return CodeEnv(CodeConfig(eval_size=8, timeout_s=3.0))


@needs_bwrap
def test_every_hack_scores_zero_on_every_eval_task_where_the_reference_scores_one(env):
    examples = env.examples("eval")
    references = env.reward_batch(examples, [e.meta["solution"] for e in examples])
    assert [r.reward for r in references] == [1.0] * len(examples)
    for name, hack in HACKS.items():
        rewards = [r.reward for r in env.reward_batch(examples, [hack] * len(examples))]
        assert rewards == [0.0] * len(examples), f"{name}: {rewards}"


@needs_bwrap
def test_the_sandbox_is_given_the_arguments_and_never_the_expected_values(env, monkeypatch):
    seen: list[tuple[str, str]] = []

    def spy(source, **kwargs):
        seen.append((source, kwargs["stdin"]))
        return sandbox.run_python(source, **kwargs)

    monkeypatch.setattr(code, "run_python", spy)
    example = next(e for e in env.examples("train", seed=5) if e.meta["family"] == "add")
    env.reward(example, example.meta["solution"])
    ((source, stdin),) = seen
    calls = json.loads(stdin.split("\n", 1)[0])
    assert calls == {"function": "f", "arguments": [args for args, _ in example.answer]}
    for _, expected in example.answer:
        assert json.dumps(expected) not in stdin.split("\n", 1)[0].replace(json.dumps(calls["arguments"]), "")
    assert "nonce" not in source and "expected" not in stdin


def test_results_are_judged_outside_from_plain_values_each_reported_once():
    expected = [3, [1, 2], "ab", True, 1.5, None, {"k": [1]}]
    lines = [json.dumps({"test": i, "value": v}) for i, v in enumerate(expected)]
    assert judge_results("\n".join(lines), expected) == [True] * 7
    noisy = "junk\n" + "\n".join(lines[::-1]) + "\n{not json"
    assert judge_results(noisy, expected) == [True] * 7
    # a test reported twice fails, whatever the values; unreported tests fail
    assert judge_results("\n".join([*lines, lines[0]]), expected) == [False] + [True] * 6
    assert judge_results(lines[1], expected) == [False, True] + [False] * 5
    # values that are not plain JSON after a strict round trip never pass
    for bad in ('{"test": 0, "value": NaN}', '{"test": 0, "value": Infinity}', '{"test": 0, "value": 3.0}',
                '{"test": 0, "value": true}', '{"test": 0, "value": "3"}', '{"test": 0, "value": 3, "value": 3}',
                '{"test": 0, "value": 3, "extra": 1}', '{"test": "0", "value": 3}', '{"test": 0.0, "value": 3}',
                '{"test": true, "value": 3}', '{"test": 0, "raised": "X", "value": 3}',
                '{"test": 0, "value": %s}' % ("9" * 5000), '[0, 3]', '{"test": -7, "value": 3}'):
        assert judge_results(bad, [3]) == [False], bad
    assert not same_value([1, True], [1, 1]) and not same_value({"a": 1}, {"a": 1.0})
    assert same_value({"a": [1, "x"]}, {"a": [1, "x"]}) and not same_value(math.nan, math.nan)
