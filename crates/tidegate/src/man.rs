//! `tidegate man`: the manual pages of `tidegate` and of every command,
//! generated from the same clap definitions as `--help` (clap_mangen), so
//! they cannot drift from the flags. `--out DIR` writes one page per command
//! (`tidegate.1`, `tidegate-serve.1`, `tidegate-ctl.1`,
//! `tidegate-ctl-status.1`, ...), as packages install them; without it the
//! pages are printed one after the other (`tidegate man | man -l -`).

use std::path::{Path, PathBuf};

/// `tidegate man`.
#[derive(clap::Args, Debug)]
pub struct ManArgs {
    /// Write one page per command into this directory (created when
    /// missing): `tidegate.1`, `tidegate-serve.1`, `tidegate-ctl.1`, ...
    /// (default: print every page to standard output).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
}

/// Why the pages could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ManError {
    /// Rendering a page (clap_mangen writes into memory, so this is
    /// clap_mangen's own error).
    #[error("rendering the manual page {page}: {source}")]
    Render { page: String, source: std::io::Error },
    /// Creating the `--out` directory.
    #[error("creating the directory {}: {source}", path.display())]
    CreateDir { path: PathBuf, source: std::io::Error },
    /// Writing a page into the `--out` directory.
    #[error("writing {}: {source}", path.display())]
    Write { path: PathBuf, source: std::io::Error },
}

/// One manual page: its file name (`tidegate-serve.1`) and its roff text.
#[derive(Debug)]
pub struct Page {
    pub file_name: String,
    pub roff: Vec<u8>,
}

/// The pages of `cmd` and of each of its visible commands, recursively
/// (hidden commands and `help` have none), in section 1.
pub fn pages(cmd: clap::Command) -> Result<Vec<Page>, ManError> {
    let mut cmd = cmd.disable_help_subcommand(true);
    // Gives each command its bin name ("tidegate serve", for the synopsis)
    // and display name ("tidegate-serve", for the title and file name).
    cmd.build();
    let mut pages = Vec::new();
    add_pages(&cmd, &mut pages)?;
    Ok(pages)
}

fn add_pages(cmd: &clap::Command, pages: &mut Vec<Page>) -> Result<(), ManError> {
    let name = cmd.get_display_name().unwrap_or_else(|| cmd.get_name()).to_owned();
    let man = clap_mangen::Man::new(cmd.clone())
        .title(name.to_uppercase())
        .section("1")
        .source(format!("tidegate {}", env!("CARGO_PKG_VERSION")))
        .manual("Tidegate Manual");
    let mut roff = Vec::new();
    man.render(&mut roff).map_err(|source| ManError::Render { page: name.clone(), source })?;
    pages.push(Page { file_name: format!("{name}.1"), roff });
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        add_pages(sub, pages)?;
    }
    Ok(())
}

/// Writes `pages` into `dir` (created when missing).
pub fn write_pages(dir: &Path, pages: &[Page]) -> Result<(), ManError> {
    std::fs::create_dir_all(dir).map_err(|source| ManError::CreateDir { path: dir.to_owned(), source })?;
    for page in pages {
        let path = dir.join(&page.file_name);
        std::fs::write(&path, &page.roff).map_err(|source| ManError::Write { path, source })?;
    }
    Ok(())
}

/// `tidegate man [--out DIR]`.
pub fn run(args: &ManArgs) -> anyhow::Result<std::process::ExitCode> {
    let pages = pages(<crate::cli::Cli as clap::CommandFactory>::command())?;
    match &args.out {
        Some(dir) => {
            write_pages(dir, &pages)?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        None => crate::write_stdout(&pages.into_iter().flat_map(|p| p.roff).collect::<Vec<_>>()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The page's text with roff's escaped hyphens (`\-`) made plain.
    fn text(roff: &[u8]) -> String {
        String::from_utf8_lossy(roff).replace("\\-", "-")
    }

    #[test]
    fn every_command_gets_a_page_and_serve_names_every_flag() {
        let cmd = <crate::cli::Cli as clap::CommandFactory>::command();
        let dir = tempfile::tempdir().unwrap();
        write_pages(dir.path(), &pages(cmd.clone()).unwrap()).unwrap();
        let read =
            |name: &str| std::fs::read(dir.path().join(name)).unwrap_or_else(|e| panic!("{name} was not written: {e}"));
        let top = text(&read("tidegate.1"));
        assert!(top.starts_with(".ie"), "roff: {}", &top[..top.len().min(200)]);
        assert!(top.contains(".TH TIDEGATE 1"), "{top}");
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
            let page = text(&read(&format!("tidegate-{}.1", sub.get_name())));
            assert!(page.contains(&format!("tidegate {}", sub.get_name())), "the synopsis of {}", sub.get_name());
            assert!(top.contains(&format!("tidegate-{}(1)", sub.get_name())), "tidegate.1 lists {}", sub.get_name());
        }
        // Nested commands get pages too; hidden ones and `help` do not.
        assert!(dir.path().join("tidegate-store-copy.1").is_file());
        assert!(!dir.path().join("tidegate-help.1").exists());
        assert!(!dir.path().join("tidegate-emulate.1").exists());

        let serve = text(&read("tidegate-serve.1"));
        let flags: Vec<_> = cmd
            .find_subcommand("serve")
            .unwrap()
            .get_arguments()
            .filter(|a| !a.is_hide_set())
            .filter_map(|a| a.get_long())
            .collect();
        assert!(flags.contains(&"data-dir") && flags.contains(&"listen"), "{flags:?}");
        for flag in flags {
            assert!(serve.contains(&format!("--{flag}")), "tidegate-serve.1 names --{flag}");
        }
    }
}
