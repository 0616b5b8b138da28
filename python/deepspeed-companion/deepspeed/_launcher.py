"""The `deepspeed` command of the companion: DeepSpeed's launcher command line on one node, run by
torch's own launcher (torch.distributed.run), so that `deepspeed train.py --deepspeed ds.json`
as the Hugging Face documentation writes it starts the script on zerotrain."""
import sys


def main():
    from zerotrain import launcher

    sys.exit(launcher.main(sys.argv[1:], prog="deepspeed"))
