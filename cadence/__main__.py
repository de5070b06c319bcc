from cadence.cli import main

# Guarded: multiprocessing imports the parent's main module again in its children (the engine core,
# forked from the fork server; tensor-parallel workers, spawned).
if __name__ == "__main__":
    raise SystemExit(main())
