from pagedchat.checkout import put_last_on_sys_path

put_last_on_sys_path()

from pagedchat.cli import main  # after: what it imports must not find the checkout first

raise SystemExit(main())
