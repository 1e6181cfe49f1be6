from pagedchat.cli import main

raise SystemExit(main())
