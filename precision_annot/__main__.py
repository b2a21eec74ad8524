from precision_annot._src.cli import main

raise SystemExit(main())
