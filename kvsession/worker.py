"""`python -m kvsession.worker`: see kvsession.connector.worker."""

from kvsession.connector.worker import main

if __name__ == "__main__":
    raise SystemExit(main())
