"""mkdocs hooks (mkdocs.yml: hooks). Pages that live beside what they describe (CHANGELOG.md,
CONTRIBUTING.md, tests/README.md, benchmarks/README.md and the results files) join the site under
their repository paths, and links between them and docs/ are rewritten for the site: the
markdown keeps links that work on GitHub and in a checkout (docs/x.md -> ../benchmarks/results/y.md)
and the site gets the same pages at the same relative places."""

from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[1]
OUTSIDE = ("CHANGELOG.md", "CONTRIBUTING.md", "tests/README.md", "benchmarks/README.md", "benchmarks/results/*.md")


def on_files(files, config):
    for pattern in OUTSIDE:
        for path in sorted(REPO.glob(pattern)):
            files.append(
                File(
                    path.relative_to(REPO).as_posix(),
                    src_dir=str(REPO),
                    dest_dir=config["site_dir"],
                    use_directory_urls=config["use_directory_urls"],
                )
            )
    return files


def on_page_markdown(markdown, page, config, files):
    up = "../" * page.file.src_uri.count("/")
    if Path(page.file.abs_src_path).is_relative_to(Path(config["docs_dir"]).resolve()):
        # docs/ is the site's root: its links up to the repository lose one "../"
        for prefix in ("CHANGELOG.md", "CONTRIBUTING.md", "tests/", "benchmarks/"):
            markdown = markdown.replace(f"]({up}../{prefix}", f"]({up}{prefix}")
        return markdown
    # a page from outside docs/: its links into docs/ lose the "docs/"
    return markdown.replace(f"]({up}docs/", f"]({up}")
