from cadence.cli import main

# Guarded: the engine-core process is started with multiprocessing's "spawn", which imports the
# parent's main module again.
if __name__ == "__main__":
    raise SystemExit(main())
