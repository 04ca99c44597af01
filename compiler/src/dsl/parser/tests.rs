//! Parser tests: the example program, every item and expression form, the
//! syntax errors, and inputs built to break it.

use super::*;

const EXAMPLE: &str = r#"# GPT-2 small
const vocab = 50257
const d = 768
const heads = 12
dim B, T
input tokens: i32[B, T]
input targets: i32[B, T]
block mlp(x) {
param fc_w: [d, 4 * d] = normal(0.02)
param fc_b: [4 * d] = zeros
param proj_w: [4 * d, d] = normal(0.02 / sqrt(2 * 12))
let h = gelu(x @ fc_w + fc_b)
return x + linear(h, proj_w)
}
param wte: [vocab, d] = normal(0.02)
param wpe: [1024, d] = normal(0.01)
let x = embedding(wte, tokens) + wpe[0:T]
let x = repeat 12 mlp(x)
let q, k, v = split(x, 3, axis = -1)
let y = x[:, 0, ...] + x[..., 1:, :-1]
train {
loss = cross_entropy(x @ transpose(wte, 0, 1), targets)
optimizer = adamw(lr = 6e-4, betas = (0.9, 0.95), eps = 1e-8, weight_decay = 0.1)
clip_grad_norm = 1.0
precision = bf16
micro_batches = 1
}
"#;

fn join<T>(xs: &[T], f: impl Fn(&T) -> String, sep: &str) -> String {
    xs.iter().map(f).collect::<Vec<_>>().join(sep)
}

/// A compact rendering that makes precedence and grouping visible.
fn sexp(e: &Expr) -> String {
    let args = |a: &[Arg]| {
        join(
            a,
            |a| match &a.name {
                Some(n) => format!("{}={}", n.name, sexp(&a.value)),
                None => sexp(&a.value),
            },
            ", ",
        )
    };
    let opt = |e: &Option<Expr>| e.as_ref().map_or(String::new(), sexp);
    match &e.kind {
        ExprKind::Int(v) => v.to_string(),
        ExprKind::Float(v) => format!("{v:?}"),
        ExprKind::Bool(b) => b.to_string(),
        ExprKind::Name(n) => n.clone(),
        ExprKind::Neg(x) => format!("(neg {})", sexp(x)),
        ExprKind::Binary { op, lhs, rhs } => {
            format!("({} {} {})", op.symbol(), sexp(lhs), sexp(rhs))
        }
        ExprKind::Call { func, args: a } => format!("{}({})", func.name, args(a)),
        ExprKind::Index { base, indices } => {
            let items = join(
                indices,
                |i| match i {
                    IndexItem::Single(e) => sexp(e),
                    IndexItem::Range { start, end, .. } => {
                        format!("{}:{}", opt(start), opt(end))
                    }
                    IndexItem::Ellipsis(_) => "...".into(),
                },
                ", ",
            );
            format!("{}[{}]", sexp(base), items)
        }
        ExprKind::List(es) => format!("[{}]", join(es, sexp, " ")),
        ExprKind::Tuple(es) => format!("(tuple {})", join(es, sexp, " ")),
        ExprKind::Repeat {
            count,
            func,
            args: a,
        } => {
            format!("(repeat {} {}({}))", sexp(count), func.name, args(a))
        }
    }
}

fn item(i: &Item) -> String {
    let names = |ns: &[Ident]| join(ns, |n| n.name.clone(), ", ");
    match i {
        Item::Const { name, value, .. } => format!("const {} = {}", name.name, sexp(value)),
        Item::Dim { names: ns, .. } => format!("dim {}", names(ns)),
        Item::Input {
            name, dtype, dims, ..
        } => {
            format!(
                "input {}: {}[{}]",
                name.name,
                dtype.name,
                join(dims, sexp, ", ")
            )
        }
        Item::Param {
            name,
            dtype,
            dims,
            init,
            ..
        } => {
            let dtype = dtype.as_ref().map_or("", |d| &d.name);
            format!(
                "param {}: {dtype}[{}] = {}",
                name.name,
                join(dims, sexp, ", "),
                sexp(init)
            )
        }
        Item::Let {
            names: ns, value, ..
        } => format!("let {} = {}", names(ns), sexp(value)),
        Item::Block(b) => {
            let body = join(&b.body, item, "; ");
            format!(
                "block {}({}) {{ {body}; return {} }}",
                b.name.name,
                names(&b.params),
                sexp(&b.ret)
            )
        }
        Item::Train(t) => {
            let entries = join(
                &t.entries,
                |e| format!("{} = {}", e.key.name, sexp(&e.value)),
                "; ",
            );
            format!("train {{ {entries} }}")
        }
    }
}

/// Spans nest, leaves span exactly their text, and operators sit between operands.
fn check_spans(src: &str, e: &Expr) {
    // A grouped expression's span covers its parentheses.
    let raw = &src[e.span.range()];
    let text = raw.trim_matches(|c| c == '(' || c == ')' || c == ' ');
    let inside = |c: &Expr| {
        assert!(
            e.span.start <= c.span.start && c.span.end <= e.span.end,
            "{text}"
        );
        check_spans(src, c);
    };
    match &e.kind {
        ExprKind::Name(n) => assert_eq!(text, n),
        ExprKind::Int(v) => assert_eq!(text.parse::<i64>().ok(), Some(*v)),
        ExprKind::Float(_) | ExprKind::Bool(_) => assert!(!text.contains(' ')),
        ExprKind::Neg(x) => (assert!(text.starts_with('-')), inside(x)).1,
        ExprKind::Binary { op, lhs, rhs } => {
            assert!(
                src[lhs.span.end..rhs.span.start].trim() == op.symbol(),
                "{text}"
            );
            (inside(lhs), inside(rhs)).1
        }
        ExprKind::Call { func, args } | ExprKind::Repeat { func, args, .. } => {
            assert_eq!(&src[func.span.range()], func.name);
            assert!(raw.ends_with(')'));
            args.iter().for_each(|a| inside(&a.value));
        }
        ExprKind::Index { base, indices } => {
            inside(base);
            for i in indices {
                match i {
                    IndexItem::Single(x) => inside(x),
                    IndexItem::Range { start, end, span } => {
                        assert!(src[span.range()].contains(':'));
                        start.iter().chain(end).for_each(inside);
                    }
                    IndexItem::Ellipsis(s) => assert_eq!(&src[s.range()], "..."),
                }
            }
        }
        ExprKind::List(es) | ExprKind::Tuple(es) => es.iter().for_each(inside),
    }
}

fn module(src: &str) -> Vec<String> {
    let m = parse(src).unwrap_or_else(|e| panic!("{}", e.render("m", src)));
    for it in &m.items {
        let mut exprs: Vec<&Expr> = Vec::new();
        match it {
            Item::Const { value, .. } | Item::Let { value, .. } => exprs.push(value),
            Item::Input { dims, .. } => exprs.extend(dims),
            Item::Param { dims, init, .. } => exprs.extend(dims.iter().chain([init])),
            Item::Block(b) => exprs.push(&b.ret),
            Item::Train(t) => exprs.extend(t.entries.iter().map(|e| &e.value)),
            Item::Dim { .. } => {}
        }
        exprs.into_iter().for_each(|e| check_spans(src, e));
    }
    m.items.iter().map(item).collect()
}

fn show(expr: &str) -> String {
    let items = module(&format!("let v = {expr}"));
    items[0].trim_start_matches("let v = ").to_string()
}

/// The single error for `src`, checked to have this message and a
/// primary span over `at` (the empty string for the end of the file).
fn fails(src: &str, message: &str, at: &str) -> Diagnostic {
    let errors = parse(src).expect_err("should not parse");
    assert_eq!(errors.0.len(), 1);
    let d = errors.0[0].clone();
    assert_eq!(d.message, message, "for {src:?}");
    for s in std::iter::once(d.span).chain(d.secondary.iter().map(|n| n.span)) {
        assert!(
            s.start <= s.end && s.end <= src.len(),
            "{s:?} in {} bytes",
            src.len()
        );
        assert!(src.is_char_boundary(s.start) && src.is_char_boundary(s.end));
    }
    assert_eq!(&src[d.span.range()], at, "span of {message:?}");
    if at.is_empty() {
        assert_eq!(d.span.start, src.len());
    }
    assert!(errors.render("m.fuse", src).contains(&d.message));
    d
}

#[test]
fn example_program() {
    let expected = [
        "const vocab = 50257",
        "const d = 768",
        "const heads = 12",
        "dim B, T",
        "input tokens: i32[B, T]",
        "input targets: i32[B, T]",
        "block mlp(x) { param fc_w: [d, (* 4 d)] = normal(0.02); param fc_b: [(* 4 d)] = zeros; \
         param proj_w: [(* 4 d), d] = normal((/ 0.02 sqrt((* 2 12)))); \
         let h = gelu((+ (@ x fc_w) fc_b)); return (+ x linear(h, proj_w)) }",
        "param wte: [vocab, d] = normal(0.02)",
        "param wpe: [1024, d] = normal(0.01)",
        "let x = (+ embedding(wte, tokens) wpe[0:T])",
        "let x = (repeat 12 mlp(x))",
        "let q, k, v = split(x, 3, axis=(neg 1))",
        "let y = (+ x[:, 0, ...] x[..., 1:, :(neg 1)])",
        "train { loss = cross_entropy((@ x transpose(wte, 0, 1)), targets); \
         optimizer = adamw(lr=0.0006, betas=(tuple 0.9 0.95), eps=1e-8, weight_decay=0.1); \
         clip_grad_norm = 1.0; precision = bf16; micro_batches = 1 }",
    ];
    assert_eq!(module(EXAMPLE), expected);
    let m = parse(EXAMPLE).unwrap();
    let spans: Vec<&str> = m.items.iter().map(|i| &EXAMPLE[i.span().range()]).collect();
    assert_eq!(spans[0], "const vocab = 50257");
    assert_eq!(spans[3], "dim B, T");
    assert_eq!(spans[4], "input tokens: i32[B, T]");
    assert!(spans[6].starts_with("block mlp(x) {") && spans[6].ends_with("proj_w)\n}"));
    assert_eq!(spans[11], "let q, k, v = split(x, 3, axis = -1)");
    assert!(spans[13].starts_with("train {") && spans[13].ends_with("micro_batches = 1\n}"));
    let Item::Block(b) = &m.items[6] else {
        panic!()
    };
    assert_eq!(&EXAMPLE[b.params[0].span.range()], "x");
    assert_eq!(
        &EXAMPLE[b.body[2].span().range()],
        "param proj_w: [4 * d, d] = normal(0.02 / sqrt(2 * 12))"
    );
}

#[test]
fn items() {
    assert!(module("").is_empty());
    assert!(module("  # nothing\n\n;;").is_empty());
    assert_eq!(module("const a = 1; const b = 2;").len(), 2);
    assert_eq!(module("dim B const x = B"), ["dim B", "const x = B"]);
    assert_eq!(
        module("param w: f32[C] = zeros"),
        ["param w: f32[C] = zeros"]
    );
    assert_eq!(
        module("input s: f32[]\nlet a, b = f(x)"),
        ["input s: f32[]", "let a, b = f(x)"]
    );
    assert_eq!(
        module("block g() { const k = 2 return k }"),
        ["block g() { const k = 2; return k }"]
    );
    assert_eq!(
        module("block f(a, b,) { return a; }"),
        ["block f(a, b) { ; return a }"]
    );
    assert_eq!(
        module("train { a = 1, b = [2]; c = x d = -1 }"),
        ["train { a = 1; b = [2]; c = x; d = (neg 1) }"]
    );
    assert_eq!(module("train {}"), ["train {  }"]);
}

#[test]
fn expressions() {
    let cases = [
        ("a + b * c @ d", "(+ a (@ (* b c) d))"),
        ("-x @ w", "(@ (neg x) w)"),
        ("a - b - c", "(- (- a b) c)"),
        ("a * b + c * d - e", "(- (+ (* a b) (* c d)) e)"),
        ("a / b * c @ d", "(@ (* (/ a b) c) d)"),
        ("--x[0]", "(neg (neg x[0]))"),
        ("a - -1", "(- a (neg 1))"),
        ("(a + b) * c", "(* (+ a b) c)"),
        ("f(x)[0][1:]", "f(x)[0][1:]"),
        ("(a)", "a"),
        ("(a,)", "(tuple a)"),
        ("(a, b,)", "(tuple a b)"),
        ("()", "(tuple )"),
        ("[]", "[]"),
        ("[1, 2.5, true, false,]", "[1 2.5 true false]"),
        ("[[1], (2, 3)][0]", "[[1] (tuple 2 3)][0]"),
        ("f()", "f()"),
        ("f(a, b = 1, c = g(2),)", "f(a, b=1, c=g(2))"),
        ("f (x)", "f(x)"),
        ("repeat n blk(x, k = 2)", "(repeat n blk(x, k=2))"),
        (
            "repeat (2 * L) blk(x)[0] + 1",
            "(+ (repeat (* 2 L) blk(x))[0] 1)",
        ),
        ("repeat 3 f(repeat 2 g(x))", "(repeat 3 f((repeat 2 g(x))))"),
        ("x[0]", "x[0]"),
        ("x[:]", "x[:]"),
        ("x[a:b, a:, :b, ..., -1,]", "x[a:b, a:, :b, ..., (neg 1)]"),
        ("x[0][1]", "x[0][1]"),
        ("x[f(1):T - 1]", "x[f(1):(- T 1)]"),
    ];
    for (src, expected) in cases {
        assert_eq!(show(src), expected, "{src}");
    }
    let m = parse("let v = (a + b) * c\nlet w = x[1:, :T]").unwrap();
    let Item::Let { value, .. } = &m.items[0] else {
        panic!()
    };
    assert_eq!(value.span, Span::new(8, 19));
    let ExprKind::Binary { lhs, .. } = &value.kind else {
        panic!()
    };
    assert_eq!(lhs.span, Span::new(8, 15), "grouping spans its parentheses");
    let Item::Let { value, .. } = &m.items[1] else {
        panic!()
    };
    let ExprKind::Index { indices, .. } = &value.kind else {
        panic!()
    };
    let Some(IndexItem::Range { span, .. }) = indices.first() else {
        panic!()
    };
    assert_eq!(*span, Span::new(30, 32));
}

#[test]
fn syntax_errors() {
    let src = "block f(x) {\n  param w: [d, 4 return x\n}";
    let d = fails(src, "expected ']' to close the shape", "return");
    assert_eq!(d.label, "found 'return'");
    assert_eq!(
        (d.secondary[0].span, d.secondary[0].message.as_str()),
        (Span::new(24, 25), "the shape starts here")
    );
    let d = fails("input x: i32[B T]", "expected ']' to close the shape", "T");
    assert_eq!(d.help, ["separate dimensions with ','"]);

    let src = "block mlp(x) {\n  let h = x\n";
    let d = fails(
        src,
        "unexpected end of file: expected '}' to close block 'mlp'",
        "",
    );
    assert_eq!(d.secondary[0].span, Span::new(13, 14));
    assert_eq!(d.help, ["a block ends with `return <expr>`"]);
    fails(
        "let x = a +",
        "unexpected end of file: expected an expression after '+'",
        "",
    );
    let d = fails(
        "let x = f(a, ",
        "unexpected end of file: expected ')' to close the call to 'f'",
        "",
    );
    assert_eq!(d.secondary[0].span, Span::new(9, 10));
    fails(
        "train { loss = x",
        "unexpected end of file: expected '}' to close the train section",
        "",
    );
    fails(
        "param w: [d]",
        "unexpected end of file: expected '=' and an initializer after the shape of 'w'",
        "",
    );

    let d = fails("let x: f32 = 1", "expected '=' after 'let x'", ":");
    assert_eq!(
        d.help,
        ["a `let` binds names to an expression: `let x = ...`"]
    );
    let d = fails("const x == 1", "expected '=' after 'const x'", "==");
    assert!(d.label == "found '=='" && d.help[0].contains("single `=`"));
    let d = fails(
        "let x = f(a == 1)",
        "expected ')' to close the call to 'f'",
        "==",
    );
    assert!(d.help[0].contains("single `=`"));
    let d = fails("block f(x) { let y = x }", "block 'f' has no return", "}");
    assert_eq!(d.help, ["a block ends with `return <expr>`"]);
    let d = fails("let input = 3", "expected a name after 'let'", "input");
    assert_eq!(
        d.help,
        ["`input` is a keyword and cannot be used as a name"]
    );
    let d = fails("let x = f(dim)", "expected an expression", "dim");
    assert_eq!(d.help, ["`dim` is a keyword and cannot be used as a name"]);
    let d = fails(
        "x = 1",
        "expected a statement (const, dim, input, param, let, block or train)",
        "x",
    );
    assert_eq!(d.help, ["to define `x`, write `let x = ...`"]);
    let d = fails(
        "block f(x) { return x let y = 1 }",
        "expected '}' to close block 'f'",
        "let",
    );
    assert!(d.help[0].starts_with("`return` ends a block"));
    fails(
        "block f(x) { input t: i32[B] return x }",
        "'input' is not allowed inside a block",
        "input",
    );
    let d = fails("train { loss: x }", "expected '=' after 'loss'", ":");
    assert_eq!(d.help, ["train settings are written `key = value`"]);

    let d = fails(
        "let x = f(a = 1, b + 1)",
        "positional argument after keyword argument",
        "b + 1",
    );
    assert_eq!(d.secondary[0].span, Span::new(10, 11));
    let d = fails(
        "...",
        "expected a statement (const, dim, input, param, let, block or train)",
        "...",
    );
    assert_eq!(d.label, "found '...'");
    let d = fails("let x = ...", "expected an expression", "...");
    assert!(d.help[0].contains("inside an index"));
    let d = fails(
        "let x = (a b)",
        "expected ')' to close the parenthesis",
        "b",
    );
    assert_eq!(d.help, ["separate tuple elements with ','"]);
    fails("let x = y[]", "empty index", "[]");
    fails("let x = y[1:2:3]", "index steps are not supported", ":");
    fails("let x = repeat mlp(x)", "missing repeat count", "mlp");
    fails(
        "let x = repeat 2 3",
        "expected the name of the block to repeat",
        "3",
    );
    fails(
        "let x = repeat 2 f + 1",
        "expected '(' and the arguments of the block to repeat",
        "+",
    );
    fails(
        "let x = (f)(x)",
        "only a function or block name can be called",
        "(",
    );
    fails(
        "let x = f(x)(y)",
        "only a function or block name can be called",
        "(",
    );
    fails("let x = [1, 2}", "expected ']' to close the list", "}");
    fails("let x = .5", "expected an expression", ".");
}

#[test]
fn lexer_errors_in_source_order() {
    fails("let x = 1 $", "unexpected character '$'", "$");
    fails("let = $", "expected a name after 'let'", "=");
    fails(
        "f $",
        "expected a statement (const, dim, input, param, let, block or train)",
        "f",
    );
    let big = "99999999999999999999999";
    fails(
        &format!("const n = {big}"),
        &format!("integer literal '{big}' is too large"),
        big,
    );
    fails("let é = 1", "unexpected character 'é'", "é");
}

#[test]
fn nesting_limit_without_stack_overflow() {
    const DEEP: &str = "expression nested too deeply (more than 200 levels)";
    // The default 2 MiB thread stack, as in any caller's thread.
    let run = std::thread::Builder::new().stack_size(2 << 20);
    run.spawn(|| {
        let d = MAX_DEPTH - 1;
        let ok = [
            format!("let x = {}x{}", "(".repeat(d), ")".repeat(d)),
            format!("let x = {}x{}", "[".repeat(d), "]".repeat(d)),
            format!("let x = {}x{}", "f(".repeat(d), ")".repeat(d)),
            format!("let x = {}x{}", "(".repeat(d), ",)".repeat(d)),
            format!("let x = {}x{}", "x[".repeat(d), "]".repeat(d)),
            format!("let x = {}x", "-".repeat(d)),
            format!("let x = {}1", "1 + ".repeat(d)),
            format!("let x = x{}", "[0]".repeat(d)),
            format!(
                "let x = {}x{}",
                "repeat 2 f(".repeat(d / 2),
                ")".repeat(d / 2)
            ),
        ];
        for src in &ok {
            assert!(parse(src).is_ok(), "{}", &src[..40]);
        }
        let n = 100_000;
        let bad = [
            format!("let x = {}", "(".repeat(n)),
            format!("let x = {}x{}", "(".repeat(n), ")".repeat(n)),
            format!("let x = {}x", "-".repeat(n)),
            format!("let x = {}", "[".repeat(n)),
            format!("let x = {}", "f(".repeat(n)),
            format!("let x = {}", "x[".repeat(n)),
            format!("let x = {}", "repeat ".repeat(n)),
            format!("let x = {}", "repeat (".repeat(n)),
            format!("let x = x{}", "[0]".repeat(n)),
            format!("let x = {}1", "1 @ ".repeat(10 * n)),
            format!("let x = {}1", "- 1 + ".repeat(n)),
            format!("let x = {}x", "-(".repeat(n)),
            format!(
                "let x = {}x{}",
                "(".repeat(MAX_DEPTH),
                ")".repeat(MAX_DEPTH)
            ),
            format!("let x = {}x", "-".repeat(MAX_DEPTH)),
        ];
        for src in &bad {
            let start = std::time::Instant::now();
            let e = parse(src).unwrap_err();
            assert_eq!(e.0[0].message, DEEP);
            assert!(start.elapsed().as_secs() < 2);
        }
        // Trees at the limit are dropped here, on this stack, too.
        drop(ok.map(|s| parse(&s)));
    })
    .unwrap()
    .join()
    .unwrap();
}

#[test]
fn huge_inputs() {
    let start = std::time::Instant::now();
    let long = "a".repeat(10 << 20);
    let d = fails(
        &long,
        "expected a statement (const, dim, input, param, let, block or train)",
        &long,
    );
    assert!(d.label.len() < 50);
    fails(
        &format!("let {long} 1"),
        "expected '=' after 'let aaaaaaaaaaaaaaaaaaaaaaaaaaaaa...'",
        "1",
    );
    assert!(parse(&format!("# {long}")).unwrap().items.is_empty());
    assert!(parse(&format!("let x = [{}]", "1, ".repeat(1 << 20))).is_ok());
    assert_eq!(
        parse(&"let x = f(x, 2)\n".repeat(100_000))
            .unwrap()
            .items
            .len(),
        100_000
    );
    fails(
        &format!("let x = {}", ")".repeat(10 << 20)),
        "expected an expression",
        ")",
    );
    assert!(start.elapsed().as_secs() < 20);
}

#[test]
fn no_input_panics() {
    // Every prefix of a real file, then random token soup.
    for (i, _) in EXAMPLE.char_indices() {
        if let Err(e) = parse(&EXAMPLE[..i]) {
            assert!(e.0[0].span.end <= i);
            e.render("m.fuse", &EXAMPLE[..i]);
        }
    }
    let pieces = [
        "(",
        ")",
        "[",
        "]",
        "{",
        "}",
        ",",
        ":",
        "...",
        ".",
        "-",
        "+",
        "@",
        "=",
        "==",
        ";",
        "x",
        "f",
        "1",
        "2.5",
        "let",
        "const",
        "block",
        "return",
        "repeat",
        "train",
        "input",
        "param",
        "dim",
        "é",
        "$",
        " ",
        "\n",
        "#",
        "99999999999999999999",
    ];
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..5000 {
        let len = next() % 40;
        let src: String = (0..len)
            .map(|_| pieces[(next() % pieces.len() as u64) as usize])
            .collect();
        if let Err(e) = parse(&src) {
            let d = &e.0[0];
            assert!(
                d.span.end <= src.len() && src.is_char_boundary(d.span.start),
                "{src:?}"
            );
            e.render("m.fuse", &src);
        }
    }
}
