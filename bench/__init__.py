"""pagedchat's benchmarks, run from the checkout: `python -m bench.run`, `python -m bench.peers ...`."""

from pagedchat.checkout import put_last_on_sys_path

put_last_on_sys_path()
