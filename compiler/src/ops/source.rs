//! Values that come from outside the step: data inputs, parameters and
//! optimizer state. The interpreter binds them; they have no inputs and no
//! gradient rule of their own (autodiff stops at them).

use super::*;

macro_rules! source_op {
    ($name:ident, $text:literal, $doc:literal) => {
        #[doc = $doc]
        #[derive(Clone, Debug, PartialEq)]
        pub struct $name {
            pub name: String,
            pub ty: TensorType,
        }

        impl OpDef for $name {
            fn class(&self) -> FusionClass {
                FusionClass::Source
            }
            fn name(&self) -> &'static str {
                $text
            }
            fn attrs(&self) -> Vec<String> {
                vec![format!("{:?}", self.name)]
            }
            fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
                expect_arity($text, inputs, 0)?;
                Ok(vec![self.ty.clone()])
            }
            fn eval(&self, _: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
                unreachable!(concat!(
                    "the interpreter binds every ",
                    $text,
                    " before evaluating"
                ))
            }
            fn vjp(
                &self,
                _: &mut Builder,
                _: &[Value],
                _: &[Value],
                _: &[Option<Value>],
            ) -> Result<Vec<Option<Value>>, OpError> {
                Ok(Vec::new())
            }
        }
    };
}

source_op!(
    Input,
    "input",
    "A data input (tokens, targets, images, labels, the learning rate)."
);
source_op!(
    Param,
    "param",
    "A trainable parameter (the fp32 master copy)."
);
source_op!(
    State,
    "state",
    "Optimizer state (AdamW moments, SGD momentum)."
);
