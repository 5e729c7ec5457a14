from trainer.main import run

run()
