"""Multi-node rehearsal on one machine (issue 39 item 7, docs/training.md "Training on a large corpus").

Two torchrun agents on loopback (``--nnodes 2 --nproc-per-node 2``, gloo, a c10d rendezvous on
127.0.0.1 at a free port) run ``tonearm train`` from shards served by a real ``moto_server`` (S3 API):

1. *corpus*: ``tonearm synth --size tiny`` (32 train clips of 2–4 s, 8 languages), a tiny teacher
   (``configs/tiny.yaml``, one epoch) for distillation, ``tonearm data shard --shard-size 5``
   (uneven shards: 5 × 6 + 2), uploaded to a bucket with boto3;
2. *ASK* (``configs/ask/ask.yaml``) and *distill_stage2* (``configs/distill_stage2.yaml``, the tiny teacher
   twice), shrunk to the tiny model with CLI overrides, one epoch each on world size 4;
3. *fail*: one train shard's audio bytes are corrupted in the bucket after it was written, and the
   ASK run continues (``resume=true optim.epochs=2 data.max_bad_fraction=0 save_every_steps=1``): the
   rank that meets it must end the whole job within 60 s with its own error;
4. *resume*: the good shard is put back and the run resumes with **one** agent (world size 4 → 2).

Every rank of every run records the ids it trained and its peak RSS through a bench-only hook
(``bench/rehearsal_hook/sitecustomize.py`` on ``PYTHONPATH``, the training code unchanged): duplicates
and coverage are counted from those ids; the peak RSS sits beside ``tonearm train CONFIG --plan``.
Writes the ``multinode_rehearsal`` section of docs/BENCHMARKS.md.

    python bench/multinode_rehearsal.py --work /tmp/rehearsal [--workers 1] [--no-write]
    python bench/multinode_rehearsal.py --work /tmp/rehearsal --render   # the section again from results.json
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.benchlib import cpu_model, moto_s3_bucket, publish_section  # noqa: E402

HOOK = Path(__file__).resolve().parent / "rehearsal_hook"
START = "<!-- bench:multinode_rehearsal:start -->"
END = "<!-- bench:multinode_rehearsal:end -->"
BUCKET = "rehearsal"
PREFIX = f"s3://{BUCKET}/shards"
FAIL_LIMIT_S = 60
FAILED_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ERROR .*rank (\d+) of (\d+) failed: (.*)$", re.M)


def load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tonearm(*args: str, env: dict[str, str] | None = None) -> None:
    subprocess.run([sys.executable, "-m", "tonearm", *args], check=True, cwd=ROOT, env=env)


def tiny_overrides() -> list[str]:
    """configs/tiny.yaml's model, crop and optimizer as overrides of a full-size preset."""
    from training.config import load_train_config

    tiny = load_train_config(ROOT / "configs" / "tiny.yaml", [])
    return ["device=cpu", "model=" + json.dumps(tiny.model.model_dump(mode="json", exclude_none=True)),
            f"data.clip_seconds={tiny.data.clip_seconds}", "optim.batch_size=2", "optim.warmup_steps=1",
            f"optim.lr={tiny.optim.lr}", "eval.every_epochs=1", "eval.batch_size=32",
            "eval.select_metric=t2a_R@10_eng"]


def served_ids(out: Path) -> dict[int, dict[int, list[str]]]:
    """{epoch: {rank: ids trained}} from the hook's files of one job."""
    got: dict[int, dict[int, list[str]]] = collections.defaultdict(dict)
    for path in sorted(out.glob("served.*.jsonl")):
        rank = int(path.name.split(".")[1])
        for line in path.read_text().splitlines():
            record = json.loads(line)
            got[record["epoch"]].setdefault(rank, []).extend(record["ids"])
    return got


def epoch_account(segments: list[dict[int, list[str]]], usable: set[str]) -> dict[str, Any]:
    """Duplicates and coverage of one epoch served in ``segments`` (one {rank: ids} per job that ran it):
    ids served more than once across every rank and segment, and the share of ``usable`` clips served.

    The hook records a batch when ``lockstep`` hands it to the step: a job killed between that and its
    next checkpoint would show that batch here and again after the resume (not in this rehearsal: the
    failing rank raises before its lockstep, and its peers fail inside theirs)."""
    counts = collections.Counter(i for segment in segments for ids in segment.values() for i in ids)
    return {"served": sum(counts.values()), "distinct": len(counts),
            "duplicates": sum(n - 1 for n in counts.values() if n > 1),
            "not_in_corpus": sorted(set(counts) - usable),
            "coverage": len(set(counts) & usable) / len(usable) if usable else 0.0}


def rss(out: Path) -> dict[int, dict[str, int]]:
    return {int(p.name.split(".")[1]): json.loads(p.read_text()) for p in sorted(out.glob("rss.*.json"))}


def metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def job(name: str, work: Path, env: dict[str, str], train_args: list[str], *, nodes: int,
        expect_fail: bool = False) -> dict[str, Any]:
    """One multi-node job: ``nodes`` torchrun agents (2 ranks each) on a loopback c10d rendezvous,
    started together like one agent per node; returns its times, exit codes and logs."""
    logs = work / "logs" / name
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    endpoint = f"127.0.0.1:{free_port()}"
    job_env = {**env, "REHEARSAL_OUT": str(logs), "PYTHONPATH": os.pathsep.join([str(HOOK), str(ROOT)]),
               "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", f"{name}-{time.time_ns()}",
               "-m", "tonearm", "train", *train_args]
    started, load_before = time.monotonic(), load()
    agents = []
    for node in range(nodes):
        sink = open(logs / f"agent{node}.log", "w")  # noqa: SIM115 - closed below
        agents.append((subprocess.Popen(command, cwd=ROOT, env=job_env, stdout=sink, stderr=subprocess.STDOUT), sink))
    codes, ended = [], []
    for process, sink in agents:
        codes.append(process.wait(timeout=900))
        ended.append(dt.datetime.now())
        sink.close()
    seconds = time.monotonic() - started
    text = "\n".join((logs / f"agent{n}.log").read_text() for n in range(nodes))
    result: dict[str, Any] = {"name": name, "seconds": seconds, "codes": codes, "load": f"{load_before} → {load()}",
                              "command": "torchrun --nnodes {} --nproc-per-node 2 --rdzv-backend c10d "
                                         "--rdzv-endpoint 127.0.0.1:PORT -m tonearm train {}".format(
                                             nodes, " ".join(a if len(a) < 60 else a.split("=", 1)[0] + "=…"
                                                             for a in train_args)),
                              "log": logs}
    if expect_fail:
        failed = FAILED_LINE.findall(text)
        if not failed:
            raise RuntimeError(f"{name}: no rank reported its failure; see {logs}")
        at = min(dt.datetime.strptime(f[0], "%Y-%m-%d %H:%M:%S,%f") for f in failed)
        result.update(failed=[{"rank": int(f[1]), "world": int(f[2]), "error": f[3]} for f in failed],
                      error_to_end_s=(max(ended) - at).total_seconds(),
                      error_lines=[line for line in text.splitlines() if line.startswith("error: ")],
                      timed_out="Timed out" in text)
    elif any(codes):
        raise RuntimeError(f"{name}: exit codes {codes}; see {logs}")
    kb_warning = re.search(r"WARNING training\.data\.shard_passes: (.*embed as zeros.*)", text)
    result["kb_pass_warning"] = kb_warning.group(1) if kb_warning else ""
    result["resume_line"] = next((line for line in text.splitlines() if "layout changed" in line
                                  or "continues at batch" in line or "starts afresh" in line), "")
    return result


def root_causes(logs: Path) -> list[tuple[int, int]]:
    """(rank, exit code) of the *root cause* each agent's summary names (an agent sees its own ranks)."""
    found = []
    for path in sorted(logs.glob("agent*.log")):
        text = path.read_text()
        if "Root Cause (first observed failure):" in text:
            root = text.split("Root Cause (first observed failure):", 1)[1]
            match = re.search(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", root, re.S)
            if match:
                found.append((int(match.group(1)), int(match.group(2))))
    return found


def corrupt_sample(shard: Path, out: Path, index: int) -> str:
    """``shard`` rewritten to ``out`` with sample ``index``'s audio bytes replaced (same members,
    a FLAC signature and zeros): corrupted after it was written. Returns that clip's id."""
    import webdataset as wds

    samples = list(wds.WebDataset(str(shard), shardshuffle=False))
    bad = json.loads(samples[index]["json"])["id"]
    with wds.TarWriter(str(out)) as writer:
        for i, sample in enumerate(samples):
            audio = next(k for k in sample if k in ("flac", "wav"))
            writer.write({"__key__": sample["__key__"], "json": sample["json"],
                          audio: b"fLaC" + bytes(512) if i == index else sample[audio]})
    return str(bad)


def plan_figure(config: str, overrides: list[str], env: dict[str, str], memory: str) -> dict[str, Any]:
    """``tonearm train CONFIG --plan`` for this rehearsal's cluster (2 nodes × 2 ranks, 2 cores,
    this machine's memory): its printed lines and the per-rank host bytes it counts for data."""
    from training.config import load_train_config
    from training.data.cluster_plan import Cluster, parse_bytes, plan_for

    args = [config, *overrides, "--plan", "--nodes", "2", "--gpus-per-node", "2", "--cores-per-node", "2",
            "--memory-per-node", memory]
    done = subprocess.run([sys.executable, "-m", "tonearm", "train", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=True)
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
    cfg = load_train_config(ROOT / config, overrides)
    plan = plan_for(cfg, Cluster(nodes=2, gpus_per_node=2, cores_per_node=2, memory_per_node=parse_bytes(memory),
                                 shm_per_node=parse_bytes(memory) // 2))
    return {"lines": done.stdout.strip().splitlines(), "host_bytes_per_rank": plan.host_bytes // 2,
            "steps": plan.steps, "coverage": plan.coverage}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=1, help="loader workers per rank")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--render", action="store_true", help="only write the section again from WORK/results.json")
    args = parser.parse_args()
    work: Path = args.work
    if args.render:
        saved = json.loads((work / "results.json").read_text())
        warning = re.search(r"WARNING training\.data\.shard_passes: (.*embed as zeros.*)",
                            saved["fail"].get("kb_pass_warning", ""))
        saved["fail"]["kb_pass_warning"] = warning.group(1) if warning else saved["fail"].get("kb_pass_warning", "")
        publish_section(section(saved, args), start=START, end=END, write=not args.no_write)
        return
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"date": dt.date.today().isoformat(), "cpu": cpu_model(), "cores": os.cpu_count()}
    base_env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()

    # 1. corpus, teacher, shards
    manifest = work / "corpus" / "manifest.jsonl"
    if not manifest.is_file():
        tonearm("synth", "--size", "tiny", "--seed", "0", "--out", str(work / "corpus"), env=base_env)
    teacher = work / "teacher"
    if not (teacher / "best").is_dir():
        tonearm("train", "configs/tiny.yaml", f"data.manifest={manifest}", f"out_dir={teacher}", "optim.epochs=1",
                "--overwrite", env=base_env)
    shards = work / "shards"
    if not (shards / "index.json").is_file():
        tonearm("data", "shard", str(manifest), "--out", str(shards), "--sample-rate", "16000", "--shard-size", "5",
                "--workers", "1", env=base_env)
    usable = {json.loads(line)["id"] for line in (shards / "records.jsonl").read_text().splitlines()
              if json.loads(line)["split"] == "train"}
    victim = shards / "train-000001.tar"
    bad_copy = work / "bad" / victim.name
    bad_copy.parent.mkdir(exist_ok=True)
    bad_id = corrupt_sample(victim, bad_copy, 3)

    with moto_s3_bucket(BUCKET, shards) as (client, aws):
        env = {**base_env, **aws}
        common = ["data.manifest=null", f"data.shards={PREFIX}", f"data.num_workers={args.workers}",
                  "distributed.timeout_s=120", *tiny_overrides()]
        ask_run, distill_run = work / "runs" / "ask", work / "runs" / "distill"
        ask = ["configs/ask/ask.yaml", *common, f"out_dir={ask_run}"]
        distill = ["configs/distill_stage2.yaml", *common, f"out_dir={distill_run}",
                   f"model.init_checkpoint={teacher / 'best'}",
                   "objective.distill.teachers=" + json.dumps([str(teacher / "best")] * 2)]
        memory = f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') // 2**30}Gi"
        results["plan"] = plan_figure(ask[0], [*ask[1:], "optim.epochs=1"], env, memory)

        # 2. an epoch of each preset on world size 4
        results["ask"] = job("ask", work, env, [*ask, "optim.epochs=1", "--overwrite"], nodes=2)
        results["distill"] = job("distill", work, env, [*distill, "optim.epochs=1", "--overwrite"], nodes=2)
        for name, run in (("ask", ask_run), ("distill", distill_run)):
            got = served_ids(results[name]["log"])
            results[name]["account"] = epoch_account([got[0]], usable)
            results[name]["rss"] = rss(results[name]["log"])
            records = metrics(run)
            results[name]["data_plan"] = next(r for r in records if r["kind"] == "data_plan")
            results[name]["epoch"] = next(r for r in records if r["kind"] == "epoch")

        # 3. a corrupted shard in the bucket: one rank fails, the job must end within 60 s
        client.upload_file(str(bad_copy), BUCKET, f"shards/{victim.name}")
        cont = [*ask, "resume=true", "optim.epochs=2", "save_every_steps=1"]
        results["fail"] = job("fail", work, env, [*cont, "data.max_bad_fraction=0"], nodes=2, expect_fail=True)
        results["fail"]["bad_id"], results["fail"]["shard"] = bad_id, victim.name

        # 4. the shard put back; the run resumes on one agent (world size 4 -> 2)
        client.upload_file(str(victim), BUCKET, f"shards/{victim.name}")
        results["resume"] = job("resume", work, env, cont, nodes=1)
        results["resume"]["rss"] = rss(results["resume"]["log"])
        epoch2 = [served_ids(results[name]["log"]).get(1, {}) for name in ("fail", "resume")]
        results["resume"]["account"] = epoch_account(epoch2, usable)
        results["resume"]["segments"] = [sum(len(v) for v in seg.values()) for seg in epoch2]
        results["resume"]["epochs"] = [r for r in metrics(ask_run) if r["kind"] == "epoch"]
    results["seconds"] = time.monotonic() - started
    results["shards"] = {"usable": len(usable), "files": sorted(p.name for p in shards.glob("train-*.tar"))}
    (work / "results.json").write_text(json.dumps(results, indent=2, default=str))
    publish_section(section(results, args), start=START, end=END, write=not args.no_write)


def _mib(value: float) -> str:
    return f"{value / 2**20:.0f} MiB"


def section(results: dict[str, Any], args: argparse.Namespace) -> str:
    plan, fail, resume = results["plan"], results["fail"], results["resume"]
    lines = [
        START,
        "## multinode_rehearsal — two torchrun agents on loopback train ASK and distill_stage2 from an S3 bucket, "
        "a rank fails, the run resumes on one agent",
        "",
        f"`python bench/multinode_rehearsal.py --work W --workers {args.workers}` · {results['cpu']}, "
        f"{results['cores']} cores · {results['date']} · {results['seconds']:.0f} s in all",
        "",
        f"Tiny synthetic corpus ({results['shards']['usable']} train clips of 2–4 s in shards of 5, uploaded to "
        "a `moto_server` bucket); presets shrunk to the tiny model with CLI overrides "
        "(`model=…`, `data.clip_seconds=2`, `optim.batch_size=2`); 2 agents × 2 gloo ranks, "
        f"{args.workers} loader worker(s) per rank. Served ids and peak RSS recorded per rank by the bench's "
        "hook (`bench/rehearsal_hook/`, the training code unchanged).",
        "",
        "| run | world | time | epoch coverage (data_plan) | clips served / distinct / duplicates | "
        "peak RSS per rank (loader worker) |",
        "|---|---|---|---|---|---|",
    ]
    for name, label in (("ask", "ASK (`configs/ask/ask.yaml`), epoch 1"),
                        ("distill", "`distill_stage2` (2 tiny teachers), epoch 1")):
        r = results[name]
        dp, acc = r["data_plan"], r["account"]
        peaks = ", ".join(f"{_mib(v['peak_rss_bytes'])} ({_mib(v['peak_worker_rss_bytes'])})"
                          for _, v in sorted(r["rss"].items()))
        lines.append(f"| {label} | {dp['world_size']} | {r['seconds']:.0f} s | {100 * dp['coverage']:.2f} % "
                     f"({dp['clips_per_epoch']} of {dp['usable_clips']}, {dp['steps_per_epoch']} steps) | "
                     f"{acc['served']} / {acc['distinct']} / **{acc['duplicates']}** | {peaks} |")
    acc = resume["account"]
    peaks = ", ".join(f"{_mib(v['peak_rss_bytes'])} ({_mib(v['peak_worker_rss_bytes'])})"
                      for _, v in sorted(resume["rss"].items()))
    lines.append(f"| ASK epoch 2: 4 ranks until the failure, then resumed on 2 | 4 → 2 | {resume['seconds']:.0f} s "
                 f"(resume) | {100 * acc['coverage']:.2f} % of the usable clips served over both segments "
                 f"({' + '.join(map(str, resume['segments']))}) | {acc['served']} / {acc['distinct']} / "
                 f"**{acc['duplicates']}** | {peaks} |")
    failed = fail["failed"][0]
    roots = root_causes(Path(fail["log"]))
    host = next((line for line in plan["lines"] if line.startswith("host memory per node")), "")
    error = fail["error_lines"][0] if fail["error_lines"] else "(no `error:` line)"
    lines += [
        "",
        f"- **`--plan` beside the measured RSS**: `tonearm train configs/ask/ask.yaml … --plan --nodes 2 "
        f"--gpus-per-node 2 --cores-per-node 2` counts {_mib(plan['host_bytes_per_rank'])} per rank for data "
        f"(index + shuffle buffers + batches in flight; {plan['steps']} steps per epoch, "
        f"{100 * plan['coverage']:.2f} % coverage — the same as the runs' data_plan). The measured peak RSS is "
        "the whole process (torch, the model, the optimizer, ASK's knowledge bases, the gloo buffers), which "
        "`--plan` does not count; here the plan's data figure is mostly its shuffle-buffer bound (`auto`: "
        "up to 1,000 crops of 2 s per worker), which a worker's 8-clip share never fills. The plan's line: "
        f"`{host}`. The loader worker's RSS counts the pages it shares with its rank after the fork.",
        f"- **A failing rank**: `{fail['shard']}`'s audio for `{fail['bad_id']}` corrupted in the bucket after "
        f"it was written, `data.max_bad_fraction=0`: rank {failed['rank']} of {failed['world']} logged "
        f"`failed: {failed['error'].split(':', 1)[0]}: …`; the job (both agents) ended **{fail['error_to_end_s']:.1f} s** after "
        f"that line ({fail['seconds']:.0f} s after the start, exit codes {fail['codes']}; limit {FAIL_LIMIT_S} s"
        f"{', met' if fail['error_to_end_s'] < FAIL_LIMIT_S else ', NOT met'}); printed: `{error[:200]}`"
        + ("; a `Timed out` appeared in the logs" if fail["timed_out"] else "; no collective timeout in the logs")
        + "; the root cause in each agent's summary (an agent sees only its own ranks): "
        + ", ".join(f"agent {n}: rank {rank}, exit code {code}" for n, (rank, code) in enumerate(roots))
        + " — the other node's ranks log `a collective failed because another rank left` (exit code 1), so "
        "on a cluster the node whose summary shows exit code 2 holds the error.",
        f"- **Resume on one agent** (the good shard put back, `resume=true`): `{resume['resume_line'].split(': ', 1)[-1][:220]}`",
        *([f"- The same corrupted clip met first by ASK's knowledge-base pass at the resume (before training): "
           f"`{fail['kb_pass_warning'][:200]}` — the pass embeds it as zeros and names it "
           "(docs/training.md), it does not count against `data.max_bad_fraction`; the training step then "
           "failed on it."] if fail.get("kb_pass_warning") else []),
        f"- `clips_served` in metrics.jsonl's epoch records is every rank's total (since the start or the resume; "
        "`clips_served_worst_rank` beside it): "
        f"{results['ask']['epoch']['clips_served']} in epoch 1 of 4 ranks, "
        f"{resume['epochs'][-1].get('clips_served')} in epoch 2 after the resume on 2; the served/distinct "
        "counts above are every rank's, from the ids the hook recorded.",
        f"- load: ASK {results['ask']['load']}, distill {results['distill']['load']}, fail {fail['load']}, "
        f"resume {resume['load']}",
        END,
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
