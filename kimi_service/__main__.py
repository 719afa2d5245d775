from kimi_service.cli import main

raise SystemExit(main())
