from kvsession.cli import main

raise SystemExit(main())
