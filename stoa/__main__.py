from stoa.cli import app

app(prog_name="stoa")
