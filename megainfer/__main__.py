from megainfer.cli import main

raise SystemExit(main())
