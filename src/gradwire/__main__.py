from gradwire.launch.cli import main

raise SystemExit(main())
