use ra_ap_syntax::ast;

// Copyright 2020 The Evcxr Authors.
//
// Licensed under the Apache License, Version 2.0 <LICENSE or
// https://www.apache.org/licenses/LICENSE-2.0> or the MIT license <LICENSE
// or https://opensource.org/licenses/MIT>, at your option. This file may not be
// copied, modified, or distributed except according to those terms.

#[derive(Debug, Eq, PartialEq)]
pub(crate) enum Import {
    /// use x as _;
    /// use x::*;
    Unnamed(String),
    /// use x::y;
    /// use x::y as z;
    Named { name: String, code: String },
}

impl Import {
    fn format(name: &str, path: &[String]) -> Import {
        let joined_path = path.join("::");
        let code = if path.last().map(String::as_str) == Some(name) {
            format!("use {joined_path};")
        } else {
            format!("use {joined_path} as {name};")
        };
        if name == "_" || name == "*" {
            Import::Unnamed(code)
        } else {
            Import::Named {
                name: name.to_string(),
                code,
            }
        }
    }
}

/// The name a use tree's `as` gives, `_` included.
fn renamed(use_tree: &ast::UseTree) -> Option<String> {
    let rename = use_tree.rename()?;
    if let Some(name) = ast::HasName::name(&rename) {
        Some(name.text().to_string())
    } else {
        rename.underscore_token().map(|underscore| underscore.text().to_string())
    }
}

pub(crate) fn use_tree_names_do(use_tree: &ast::UseTree, out: &mut impl FnMut(Import)) {
    fn process_use_tree(use_tree: &ast::UseTree, prefix: &[String], out: &mut impl FnMut(Import)) {
        // `{a, b}` with no path before it (`use {a, b};`, `use a::{{b, c}}`):
        // each subtree under the prefix so far.
        if use_tree.path().is_none() {
            if let Some(tree_list) = use_tree.use_tree_list() {
                for subtree in tree_list.use_trees() {
                    process_use_tree(&subtree, prefix, out);
                }
            }
            return;
        }
        if let Some(path) = use_tree.path() {
            // `self` names what we've got so far, by its own name or by the
            // one `as` gives it.
            if path.segment().and_then(|segment| segment.kind())
                == Some(ast::PathSegmentKind::SelfKw)
            {
                if let Some(last) = prefix.last() {
                    let name = renamed(use_tree).unwrap_or_else(|| last.clone());
                    out(Import::format(&name, prefix));
                }
                return;
            }

            // Collect the components of `path`.
            let mut path = path;
            let mut path_parts = Vec::new();
            loop {
                if let Some(segment) = path.segment() {
                    if let Some(name_ref) = segment.name_ref() {
                        path_parts.push(name_ref.text().to_owned());
                    } else if let Some(token) = segment.crate_token() {
                        path_parts.push(token.text().to_owned());
                    }
                    if let Some(qualifier) = path.qualifier() {
                        path = qualifier;
                        continue;
                    }
                }
                break;
            }
            path_parts.reverse();

            // Combine the existing prefix with the new path components.
            let mut new_prefix = Vec::with_capacity(prefix.len() + path_parts.len());
            new_prefix.extend(prefix.iter().cloned());
            new_prefix.append(&mut path_parts);

            // Recurse into any subtree.
            if let Some(tree_list) = use_tree.use_tree_list() {
                for subtree in tree_list.use_trees() {
                    process_use_tree(&subtree, &new_prefix, out);
                }
            } else if let Some(name) = renamed(use_tree) {
                out(Import::format(&name, &new_prefix));
            } else if let Some(star_token) = use_tree.star_token() {
                new_prefix.push(star_token.text().to_owned());
                out(Import::format(star_token.text(), &new_prefix));
            } else if let Some(ident) = new_prefix.last() {
                out(Import::format(ident, &new_prefix));
            }
        }
    }

    process_use_tree(use_tree, &[], out);
}

#[cfg(test)]
mod tests {
    use super::Import;
    use super::use_tree_names_do;
    use ra_ap_syntax::ast;
    use ra_ap_syntax::ast::HasModuleItem;

    fn use_tree_names(code: &str) -> Vec<Import> {
        let mut out = Vec::new();
        let file = ast::SourceFile::parse(code, crate::rust_analyzer::EDITION);
        for item in file.tree().items() {
            if let ast::Item::Use(use_stmt) = item
                && let Some(use_tree) = use_stmt.use_tree()
            {
                use_tree_names_do(&use_tree, &mut |import| {
                    out.push(import);
                });
            }
        }
        out
    }

    fn unnamed(code: &str) -> Import {
        Import::Unnamed(code.to_owned())
    }

    fn named(name: &str, code: &str) -> Import {
        Import::Named {
            name: name.to_owned(),
            code: code.to_owned(),
        }
    }

    #[test]
    fn test_complex_tree() {
        assert_eq!(
            use_tree_names(
                "use std::collections::{self, hash_map::{HashMap}, HashSet as MyHashSet};"
            ),
            vec![
                named("collections", "use std::collections;"),
                named("HashMap", "use std::collections::hash_map::HashMap;"),
                named("MyHashSet", "use std::collections::HashSet as MyHashSet;")
            ]
        );
    }

    #[test]
    fn test_underscore() {
        assert_eq!(
            use_tree_names("use foo::bar::MyTrait as _;"),
            vec![unnamed("use foo::bar::MyTrait as _;"),]
        );
    }

    #[test]
    fn test_self_renamed() {
        assert_eq!(
            use_tree_names("use vramlab::candle_nn::{self as nn, Module};"),
            vec![
                named("nn", "use vramlab::candle_nn as nn;"),
                named("Module", "use vramlab::candle_nn::Module;")
            ]
        );
        assert_eq!(
            use_tree_names("use a::b::{self as _};"),
            vec![unnamed("use a::b as _;")]
        );
    }

    #[test]
    fn test_braces_without_a_path() {
        assert_eq!(
            use_tree_names("use {std::fmt::Write, std::io::{self as stdio, Read as _}};"),
            vec![
                named("Write", "use std::fmt::Write;"),
                named("stdio", "use std::io as stdio;"),
                unnamed("use std::io::Read as _;")
            ]
        );
        assert_eq!(
            use_tree_names("use std::collections::{{HashMap, hash_map::{Entry as E}}};"),
            vec![
                named("HashMap", "use std::collections::HashMap;"),
                named("E", "use std::collections::hash_map::Entry as E;")
            ]
        );
    }

    #[test]
    fn test_pub_use() {
        assert_eq!(
            use_tree_names("pub use std::collections::{self as c, BTreeMap};"),
            vec![
                named("c", "use std::collections as c;"),
                named("BTreeMap", "use std::collections::BTreeMap;")
            ]
        );
    }

    #[test]
    fn test_glob() {
        assert_eq!(
            use_tree_names("use foo::bar::*;"),
            vec![unnamed("use foo::bar::*;"),]
        );
    }
}
