"""tonearm: multilingual audio–text retrieval — corpus, training, evaluation, bundles, search.

One subcommand per step of the pipeline (docs/ARCHITECTURE.md).

Handlers are imported lazily so that a service-only install (no torch) can run
`serve` and `bundle ...` while `train` tells the user which extra is missing.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

from tonearm.errors import TonearmError

log = logging.getLogger("tonearm")
OWN_LOGGERS = frozenset({"tonearm", "training", "index", "service", "bench", "__main__"})
"""Top-level logger names whose INFO lines a CLI user sees (libraries: warnings and errors only)."""
BENCH_DIR = str(Path(__file__).resolve().parents[1] / "bench")


class OwnInfoOnly(logging.Filter):
    """Pass INFO from tonearm's own code (packages, benchmark scripts and their helpers); from
    libraries (``INFO httpx: HTTP Request …``, faiss's loader, …) only warnings and errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (
            record.levelno >= logging.WARNING
            or record.name.split(".")[0] in OWN_LOGGERS
            or record.pathname.startswith(BENCH_DIR)
        )


Handler = Callable[[argparse.Namespace], int]


def _lazy(target: str, extra: str) -> Handler:
    """A handler that imports ``module:function`` on first call, naming the pip extra if it fails."""

    def run(args: argparse.Namespace) -> int:
        module_name, function_name = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            missing = err.name or "a dependency"
            if missing.split(".")[0] in {"tonearm", "training", "index", "service"}:
                raise
            raise TonearmError(
                f"`tonearm {args.command}` needs {missing!r}; install it with: pip install 'tonearm[{extra}]'"
            ) from err
        handler: Handler = getattr(module, function_name)
        return handler(args)

    return run


def _add_synth(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("synth", help="write the procedural multilingual sound-scene corpus (docs/corpus.md)")
    p.add_argument("--size", choices=["tiny", "small"], default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory (WAV files + manifest.jsonl)")
    p.add_argument("--noise", type=_noise_fraction, default=0.0, metavar="P",
                   help="replace a fraction P in [0, 1) of the training captions with other clips' "
                        "(noisy correspondences; recorded in each clip's meta.noisy_captions)")
    p.add_argument("--moments", action="store_true",
                   help="long recordings with captioned moments and exact boundaries (docs/corpus.md, Moments)")
    p.add_argument("--bed-seconds", type=float, nargs=2, metavar=("MIN", "MAX"), default=None,
                   help="with --moments: recording lengths in seconds (default: the size's; 1-10 min: 60 600)")
    p.set_defaults(handler=_lazy("training.data.synth_moments:cli_synth", "train"))


def _noise_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--noise must be a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"--noise must be in [0, 1), got {value}")
    return value


def _add_data(sub: argparse._SubParsersAction) -> None:
    # training/data/cli.py and the modules it imports are stdlib + numpy only (no torch), so building
    # its parser here stays cheap.
    try:
        from training.data.cli import add_data_parser
    except ModuleNotFoundError as err:  # the service image ships no training code
        if err.name not in {"training", "training.data"}:
            raise
        return
    add_data_parser(sub)


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a dual encoder from a YAML config")
    p.add_argument("config", nargs="?", help="YAML preset (configs/*.yaml); defaults when omitted")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=1e-3 data.manifest=x.jsonl")
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="train with N processes on this node via torchrun (gloo on CPU, NCCL on GPUs; "
        "docs/training.md, Distributed)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace a previous run in out_dir (else: resume=true or refused)"
    )
    p.add_argument(
        "--drop-other-languages",
        action="store_true",
        help="drop captions in languages outside data.languages (same as data.drop_other_languages=true)",
    )
    plan = p.add_argument_group("dry run (--plan): the plan and memory of a data.shards run on a cluster, no training")
    plan.add_argument("--plan", action="store_true", help="print steps per epoch, coverage, loader workers, shuffle "
                      "buffers, host and /dev/shm use per node, and per rank the model, gradients, AdamW state and "
                      "ASK knowledge bases against GPU and host memory, for the cluster below, and exit; refuse a "
                      "plan that does not fit")
    plan.add_argument("--nodes", type=int, default=1, help="with --plan: nodes (default 1)")
    plan.add_argument("--gpus-per-node", type=int, default=8, help="with --plan: GPUs = ranks per node (default 8)")
    plan.add_argument("--cores-per-node", type=int, default=96, help="with --plan: CPU cores per node (default 96)")
    plan.add_argument("--memory-per-node", default="512Gi", help="with --plan: memory per node (default 512Gi)")
    plan.add_argument("--shm-per-node", default=None, help="with --plan: /dev/shm per node (default: half the memory)")
    plan.add_argument("--gpu-memory", default="80Gi", help="with --plan: memory of one GPU (default 80Gi)")
    plan.add_argument("--process-baseline", default=None, metavar="FILE",
                      help="with --plan: the processes' own memory measured on the training machine by `python -m "
                      "training.memory_calibration --out FILE` (default: $TONEARM_PROCESS_BASELINE, else a figure "
                      "measured on one machine; docs/training.md); with --emit-k8s the Job carries the file in its "
                      "ConfigMap and sets $TONEARM_PROCESS_BASELINE to it in the pods")
    plan.add_argument("--emit-k8s", action="store_true", help="(implies --plan) print the multi-node Kubernetes Job "
                      "(k8s/train-multinode/job.yaml: the config's ConfigMap and the Job) with the CPU, memory and "
                      "/dev/shm of this plan for a pod's share of each node, training from data.shards; the plan goes "
                      "to stderr (docs/deploy.md)")
    plan.add_argument("--allocatable-per-node", default=None, metavar="cpu=…,memory=…",
                      help="with --plan: what one pod may request on a node (kubectl describe node: Allocatable, less "
                      "the DaemonSets' requests), e.g. cpu=95690m,memory=470Gi; the plan and the Job are made for it "
                      "(--emit-k8s without it: GKE's reservation formula and 1 core + 2 GiB for DaemonSets below "
                      "--cores-per-node and --memory-per-node)")
    p.set_defaults(handler=_lazy("training.launch:cli_train", "train"))


def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="recall, mAP@10 and consistency of a checkpoint (docs/metrics.md)")
    p.add_argument("checkpoint", help="checkpoint directory (runs/NAME/best)")
    p.add_argument("--data", required=True, help="JSONL manifest")
    p.add_argument("--split", default="test")
    p.add_argument("--out", help="report directory (default: CHECKPOINT/eval-SPLIT)")
    p.add_argument("--moments", action="store_true",
                   help="moment retrieval in the manifest's long recordings (Recall1@0.5/0.7, mAP@[0.5:0.95] per "
                   "language; docs/metrics.md): CHECKPOINT is then a bundle directory")
    clips, moments = _lazy("training.evaluate:cli_evaluate", "train"), _lazy("training.moment_evaluate:cli_evaluate_moments", "train")
    p.set_defaults(handler=lambda args: moments(args) if args.moments else clips(args))


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export a checkpoint (or a pretrained CLAP / PE-Audio folder) to a bundle (ONNX + FAISS + manifest)")
    p.add_argument("checkpoint", nargs="?", help="checkpoint directory (runs/NAME/best); omit with --pretrained")
    p.add_argument(
        "--pretrained",
        metavar="MODEL_DIR",
        help="a saved Hugging Face model folder — ClapModel (LAION CLAP) or PeAudioModel (Meta PE-Audio), "
        "read from its config.json model_type — with its weights, preprocessor_config.json and tokenizer: "
        "bundle its own encoders without training (docs/models.md, 'Bring your own model')",
    )
    p.add_argument(
        "--languages", nargs="+", metavar="LANG",
        help="with --pretrained: caption languages to index (default: those of the manifest)",
    )
    p.add_argument("--data", required=True, help="JSONL manifest whose clips are indexed")
    p.add_argument("--out", required=True, help="bundles directory; the bundle is written inside it")
    p.add_argument(
        "--split",
        action="append",
        metavar="SPLIT",
        help="index only the clips of this split (repeatable, e.g. --split test); default: every split",
    )
    p.add_argument("--index", help="FAISS factory string (default: chosen by collection size)")
    p.add_argument(
        "--quantize", choices=("none", "text", "audio", "both"), default=None,
        help="quantize these encoders (dynamic int8), measured against fp32 on the held-out set (docs/bundle.md)",
    )
    p.add_argument("--quantize-text", action="store_true", help="same as --quantize text (older spelling)")
    p.add_argument("--quantize-precision", choices=("int8", "fp16"), default="int8",
                   help="int8: dynamic int8 for CPUs; fp16: for GPU providers (not measured on a GPU here)")
    p.add_argument("--quantize-max-drop", type=float, default=1.0, metavar="POINTS",
                   help="largest held-out R@10 drop against fp32 the quantized bundle may have (default 1 point)")
    p.add_argument("--quantize-on-loss", choices=("refuse", "warn"), default="refuse",
                   help="past --quantize-max-drop: refuse the export (exit status 2) or only warn")
    _add_ray_options(p)
    _add_device_option(p)
    _add_decode_limits(p)
    p.set_defaults(handler=_lazy("training.bundle.cli:cli_export", "train"))


def _add_index(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "index", help="index a folder of your own audio files with a bundle's encoders (docs/bundle.md)"
    )
    p.add_argument("audio_dir", help="folder searched recursively; files soundfile cannot read are skipped")
    p.add_argument("--bundle", required=True, help="source bundle whose ONNX encoders and tokenizer are reused")
    p.add_argument("--out", required=True, help="new bundle directory (its name is the bundle id; must not exist)")
    p.add_argument("--metadata", metavar="PATH", default=None,
                   help="per-file metadata, CSV or JSONL with a 'file' column (default: AUDIO_DIR/metadata.jsonl "
                        "or metadata.csv when present); the filters' fields (docs/bundle.md)")
    _add_ray_options(p)
    _add_device_option(p)
    _add_decode_limits(p)
    milvus = p.add_argument_group(
        "publishing straight to Milvus (with --ray)",
        "each Ray worker writes its vectors into the bundle's Milvus collection, which is then registered as "
        "`tonearm bundle publish` does; --out gets the ids and encoders but no FAISS file (docs/deploy.md)",
    )
    milvus.add_argument("--milvus-uri", metavar="URI", help="a Milvus server, e.g. http://milvus:19530 "
                        "(not a Milvus Lite file: the workers are other processes)")
    milvus.add_argument("--milvus-token-env", metavar="VAR", help="environment variable holding the Milvus token")
    milvus.add_argument("--milvus-index", choices=("FLAT", "IVF_FLAT", "HNSW", "AUTOINDEX"), default=None,
                        help="Milvus index type of the collection (default FLAT = exact)")
    p.set_defaults(handler=_lazy("index.catalogue.own_audio:cli_index", "service"))


def _add_device_option(p: argparse.ArgumentParser) -> None:
    """`--device cpu|cuda` and `--precision fp32|fp16`: where and in what precision the in-process embedding pass
    runs (docs/models.md, "Where the catalogue pass runs")."""
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cuda: embed with ONNX Runtime's CUDA provider (needs onnxruntime-gpu and an NVIDIA GPU; "
        "refused in one line without them); default cpu",
    )
    p.add_argument(
        "--precision", choices=("fp32", "fp16"), default="fp32",
        help="fp16 (with --device cuda): the catalogue pass runs fp16 copies of the encoders, after a parity check "
        "against fp32 on a probe set (stops in one line below centred cosine 0.999); the bundle keeps its fp32 "
        "encoders for queries and records the pass in its manifest (docs/models.md); default fp32",
    )
    p.add_argument(
        "--decode-workers", type=_non_negative_int, default=None, metavar="N",
        help="processes decoding clips beside the encoder (0: decode in the encoder's process; default: the "
        "cores left after the encoder's; docs/models.md, \"Throughput\")",
    )
    p.add_argument(
        "--devices", default=None, metavar="0,1,...|all",
        help="with --device cuda: split the catalogue over these GPUs, one process each, merged into the "
        "bundle one GPU writes (default: the first GPU only)",
    )
    p.add_argument(
        "--codec-call-samples", type=_positive_int, default=None, metavar="N",
        help="PE-Audio: most samples (padding included) in one encoder call of the catalogue pass; clips of one "
        "length bucket share calls when two fit, long ones too (default 7680000 with --device cuda, 960000 "
        "on the CPU as in the service; docs/models.md, 'PE-Audio: length buckets')",
    )


def _add_decode_limits(p: argparse.ArgumentParser) -> None:
    """What one catalogue file may cost to decode, and the bytes the pass's decoding may hold (index.audio.decode
    .DecodeLimits, docs/bundle.md "Decode limits"): a file past a limit is skipped and listed with the reason."""
    limits = p.add_argument_group(
        "decode limits", "a catalogue file past one is skipped and listed in the manifest's skipped_clips with the "
        "reason; 0 lifts a limit (docs/bundle.md, 'Decode limits')")
    limits.add_argument("--min-sample-rate", type=_non_negative_int, default=None, metavar="HZ",
                        help="lowest source sample rate decoded (default 1000: a file declaring a few hertz resamples "
                        "into GiBs)")
    limits.add_argument("--max-decode-samples", type=_non_negative_int, default=None, metavar="N",
                        help="most frames x channels one file may decode (default 1382400000: 4 h of 48-kHz stereo)")
    limits.add_argument("--max-decoded-bytes", type=_non_negative_int, default=None, metavar="BYTES",
                        help="most memory one file's decoding may hold, about twice its output (default 2147483648: "
                        "~1.5 h of audio at 48 kHz)")
    limits.add_argument("--decode-memory", type=_positive_int, default=None, metavar="BYTES",
                        help="most memory the pass's decoding holds at once, decodes in flight and decoded clips "
                        "waiting for the encoder, shared among --devices (default 2147483648; one file alone may "
                        "pass it up to --max-decoded-bytes)")


def _add_ray_options(p: argparse.ArgumentParser) -> None:
    """`--ray [ADDRESS]` and `--ray-workers N`: the embedding pass as a Ray Data job (docs/deploy.md, Ray)."""
    p.add_argument(
        "--ray", nargs="?", const="", default=None, metavar="ADDRESS",
        help="embed on a Ray cluster: ADDRESS is auto, HOST:PORT or ray://HEAD:10001; without one, "
        "RAY_ADDRESS, else the cluster started on this machine, else a new local Ray (needs tonearm[ray])",
    )
    p.add_argument("--ray-workers", type=_positive_int, default=None, metavar="N",
                   help="embedding actors (one ONNX session each; default: one per CPU of the cluster, or per "
                   "GPU with --device cuda)")
    p.add_argument("--ray-cpus-per-worker", type=_positive_int, default=None, metavar="N",
                   help="CPUs each actor reserves for decoding and its ONNX threads (default 1; 4 with --device cuda)")


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_bundle(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bundle", help="inspect bundles, or manage a running service's bundles")
    bsub = p.add_subparsers(dest="bundle_command", required=True)
    verify = bsub.add_parser("verify", help="checksums, dimensions, ONNX shapes, index sizes")
    verify.add_argument("dir")
    verify.set_defaults(handler=_lazy("index.runtime.cli:cli_verify", "service"))
    evaluate = bsub.add_parser("eval", help="metrics (docs/metrics.md) from the ONNX encoders and FAISS indices only")
    evaluate.add_argument("dir")
    evaluate.set_defaults(handler=_lazy("index.runtime.cli:cli_eval", "service"))
    publish = bsub.add_parser(
        "publish", help="write a bundle's vectors to Milvus collections named by its id (docs/service.md)"
    )
    publish.add_argument("bundle", help="bundle directory")
    publish.add_argument("--milvus-uri", required=True, help="e.g. http://milvus:19530, or a local *.db file (Milvus Lite)")
    publish.add_argument("--milvus-token-env", metavar="VAR", help="environment variable holding the Milvus token")
    publish.add_argument("--milvus-index", default="FLAT", choices=("FLAT", "IVF_FLAT", "HNSW", "AUTOINDEX"),
                         help="Milvus index type of the collections (FLAT = exact)")
    publish.set_defaults(handler=_lazy("index.engines.milvus_windows:cli_publish", "milvus"))
    for name, help_text in (
        ("list", "bundles known to a running service"),
        ("activate", "activate a bundle on a running service (runs the quality gate)"),
        ("rollback", "return a running service to its previous bundle"),
    ):
        q = bsub.add_parser(name, help=help_text)
        q.add_argument("--url", required=True, help="service base URL, e.g. http://127.0.0.1:8000")
        q.add_argument("--token-env", default="TONEARM_ADMIN_TOKEN", help="environment variable holding the admin token")
        if name == "list":
            q.add_argument("--json", action="store_true", help="print the service's JSON answer instead of a table")
        if name == "activate":
            q.add_argument("bundle_id")
            q.add_argument("--force", action="store_true", help="skip the quality gate")
        q.set_defaults(handler=_lazy(f"service.admin_client:cli_{name}", "service"))


def _settings_epilog() -> str:
    """Every ``TONEARM_*`` setting of the service with its default (service.settings.Settings)."""
    try:
        from service.settings import Settings
    except ModuleNotFoundError:  # no service extra: `serve` says which extra it needs when run
        return "environment: TONEARM_* variables (docs/service.md, 'Settings')"
    names = []
    for name, field in Settings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        shown = "-" if default is None else str(default).lower() if isinstance(default, bool) else default
        names.append(f"TONEARM_{name.upper()}={shown}")
    intro = textwrap.fill(
        "Every setting is a TONEARM_* environment variable (the flags above override theirs); "
        "what each means: docs/service.md, 'Settings'. Defaults:", 79
    )
    return intro + "\n  " + "\n  ".join(names)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve search over a bundle (builds the demo bundle when none is set)",
        description=textwrap.fill(
            "Serve the search API and demo page over a bundle. With no --bundle and no TONEARM_BUNDLE or "
            "TONEARM_BUNDLES_DIR, the embedded demo bundle is built once and cached in TONEARM_HOME/demo.", 79
        ),
        epilog=_settings_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--bundle", metavar="DIR", help="bundle directory to serve (env TONEARM_BUNDLE, which also "
                   "takes a bundle id inside TONEARM_BUNDLES_DIR; default: the embedded demo bundle)")
    p.add_argument("--host", default=None, help="address to listen on (env TONEARM_HOST; default 127.0.0.1; "
                   "0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=None, help="TCP port (env TONEARM_PORT; default 8000); "
                   "a port already in use is refused with exit status 2")
    p.add_argument("--workers", type=int, default=None, help="uvicorn worker processes (env TONEARM_WORKERS; "
                   "default 1; more than 1 needs TONEARM_REDIS_URL)")
    p.set_defaults(handler=_lazy("tonearm.serve:cli_serve", "service"))


def _add_items(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("items", help="the item log of POST /v1/items (docs/service.md, Items)")
    isub = p.add_subparsers(dest="items_command", required=True)
    export = isub.add_parser(
        "export", help="write the log's current items as a folder `tonearm index` takes (audio named by id + metadata.jsonl)")
    where = export.add_mutually_exclusive_group(required=True)
    where.add_argument("--items-dir", metavar="DIR", help="the item log's directory (TONEARM_ITEMS_DIR)")
    where.add_argument("--bundles-dir", metavar="DIR", help="the bundles directory (its log is DIR/.items)")
    export.add_argument("--out", required=True, help="new folder (must not exist)")
    export.set_defaults(handler=_lazy("index.items.export:cli_export", "service"))
    compact = isub.add_parser(
        "compact", help="rewrite the log as its live items and deletes and remove the audio no live item uses "
        "(safe while replicas serve it; docs/service.md, Items, Compaction)")
    where = compact.add_mutually_exclusive_group(required=True)
    where.add_argument("--items-dir", metavar="DIR", help="the item log's directory (TONEARM_ITEMS_DIR)")
    where.add_argument("--bundles-dir", metavar="DIR", help="the bundles directory (its log is DIR/.items)")
    compact.set_defaults(handler=_lazy("index.items.log:cli_compact", "service"))


def _add_train_moments(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-moments", help="train the temporal moment head on a bundle's window embeddings and "
                                             "write a new bundle that carries it (docs/objectives.md, Moments)")
    p.add_argument("--bundle", required=True, help="bundle whose frozen encoders embed the windows and captions")
    p.add_argument("--manifest", required=True, help="manifest with moments (tonearm synth --moments)")
    p.add_argument("--split", default="train")
    p.add_argument("--heldout-split", default="test",
                   help="the manifest's split whose recordings with moments measure both scorers side by side, "
                        "kept in the new bundle for the quality gate ('none': skip; docs/bundle.md, Moment head)")
    p.add_argument("--out", help="the new bundle's directory: the input bundle's files (untouched) plus the head "
                                  "(default: <bundle id>-head-s<seed> beside the input; docs/bundle.md, Moment head)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=600)
    p.set_defaults(handler=_lazy("training.moment_head:cli_train_moments", "train"))


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark of a source checkout (bench/NAME.py), e.g. `bench quality`",
                       add_help=False)
    p.add_argument("name", help="benchmark name: quality (docs/results/), or any bench/NAME.py")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments (NAME --help)")
    p.set_defaults(handler=_lazy("tonearm.bench:cli_bench", "train"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tonearm", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_synth, _add_data, _add_train, _add_evaluate, _add_export, _add_index, _add_bundle, _add_items, _add_serve,
                _add_train_moments, _add_bench):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "train" and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]  # overrides after a flag: train CFG --overwrite a=1
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "ray_workers", None) is not None and args.ray is None:
        parser.error("--ray-workers needs --ray [ADDRESS]")
    if args.command == "index":
        if args.milvus_uri and args.ray is None:
            parser.error("--milvus-uri needs --ray [ADDRESS] (without Ray: build the bundle, then run "
                         "`tonearm bundle publish BUNDLE --milvus-uri URI`)")
        if not args.milvus_uri and (args.milvus_token_env or args.milvus_index):
            parser.error("--milvus-token-env and --milvus-index need --milvus-uri")
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # re-launched by `train --nproc-per-node`
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:  # -v shows every library's debug lines too
        for handler in logging.getLogger().handlers:
            handler.addFilter(OwnInfoOnly())
    try:
        return int(args.handler(args) or 0)
    except TonearmError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
