from rltrain import lazy_dynamo

lazy_dynamo.install()  # this process is rltrain's, as the CLI's is: in-process cases step as a run does

from benchmarks.cli import main  # noqa: E402

if __name__ == "__main__":  # spawned collector workers re-import this module: they must not run it
    main()
