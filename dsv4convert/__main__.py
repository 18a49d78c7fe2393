from dsv4convert.cli import main

raise SystemExit(main())
