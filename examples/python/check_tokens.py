"""The Python engines through SmartGenConnector generate exactly the C engine's greedy tokens:
examples/disagg's smartgen-disagg --mode colocated (itself bit-identical to llama2.c's run.c) on the
same prompt, against disagg.py --pair with the full path and with the selective paths at a budget of
the whole prompt; a selective run at a quarter budget must run to the end (its tokens may differ:
it attends to the essential blocks until the rest arrive). ctest example.python.connector.

    check_tokens.py SMARTGEN_DISAGG_BINARY
"""

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    disagg_bin = sys.argv[1]
    with open(os.path.join(HERE, "..", "disagg", "data", "prompts-tinystories.json")) as f:
        prompt = json.load(f)[0]["tokens"]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompt, f)
        prompt_file = f.name
    try:
        c = subprocess.run([disagg_bin, "--mode", "colocated", "--prompt-tokens", prompt_file, "--max-new-tokens", "64",
                            "--json", "--quiet"], capture_output=True, text=True, timeout=120)
        if c.returncode:
            print(f"FAIL: smartgen-disagg exited {c.returncode}: {c.stderr}")
            return 1
        want = json.loads(c.stdout.strip().splitlines()[-1])["tokens"]

        def pair(*extra):
            r = subprocess.run([sys.executable, os.path.join(HERE, "disagg.py"), "--pair", "--json", "--prompt-tokens",
                                prompt_file, *extra], capture_output=True, text=True, timeout=300)
            if r.returncode:
                print(f"FAIL: disagg.py --pair {' '.join(extra)}: exit {r.returncode}\n{r.stdout}{r.stderr}")
                return None
            return json.loads(r.stdout.strip().splitlines()[-1])

        failed = 0
        for extra, must_equal in ((("",), True), (("--selective", "--budget", "1.0"), True),
                                  (("--selective", "--budget", "0.25"), False)):
            extra = tuple(e for e in extra if e)
            got = pair(*extra)
            if got is None:
                failed = 1
                continue
            same = got["tokens"] == want
            print(f"[ info ] python {got['mode']} budget {got['budget']}: {len(got['tokens'])} tokens, "
                  f"{'equal to' if same else 'differ from'} the C engine's; TTFT {got['ttft_ms']} ms, TTST "
                  f"{got['ttst_ms']} ms, {got['sparse_steps']} sparse steps, transfer done {got['transfer_done_ms']} ms")
            if must_equal and not same:
                print(f"FAIL: tokens differ\n  C:      {want}\n  Python: {got['tokens']}")
                failed = 1
            if len(got["tokens"]) != len(want):
                print("FAIL: the run stopped early")
                failed = 1
        return failed
    finally:
        os.unlink(prompt_file)


if __name__ == "__main__":
    sys.exit(main())
