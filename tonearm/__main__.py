"""``python -m tonearm …``: the CLI as a module, which is what torchrun launches.

    torchrun --standalone --nproc-per-node 2 -m tonearm train configs/tiny.yaml

(``tonearm train --nproc-per-node 2 configs/tiny.yaml`` runs that command for you;
docs/training.md, "Distributed".)
"""

from tonearm.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
