"""``python -m rltrain``. Kept import-free: spawned collector workers re-import this module."""

if __name__ == "__main__":
    from rltrain.cli import main

    main()
