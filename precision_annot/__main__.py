from precision_annot.cli import main

raise SystemExit(main())
