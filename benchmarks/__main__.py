from benchmarks.cli import main

if __name__ == "__main__":  # spawned collector workers re-import this module: they must not run it
    main()
