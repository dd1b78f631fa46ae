// TensorRT IPluginV3 "DhsResolver": the batched three-step resolver (dhisparse/resolver.h) as one layer.
#pragma once

#include "../common/plugin_base.h"

namespace dhisparse
{
namespace trt
{

//! Inputs (int32, linear): 0 positions [R, N], 1 page_table [R, M], 2 hot_pos [R, B], 3 hot_stamp [R, B],
//! 4 hot_loc [R, B], 5 stamp [1].
//! Outputs: 0 locations [R, N] int32, 1 steps [R, N] int8, 2 hot_pos [R, B] int32, 3 hot_stamp [R, B] int32,
//! 4 copy_position [R, N], 5 copy_slot [R, N], 6 copy_location [R, N] (int32, -1 padded),
//! 7 summary [R, 6] int32 (status, num_union, num_copies, direct, hot, host).
//! Field: page_rows (int32 > 0).
class ResolverPlugin : public PluginBase<ResolverPlugin>
{
public:
    static constexpr char const* kName = "DhsResolver";
    static constexpr char const* kVersion = "1";
    static constexpr int32_t kNbInputs = 6;
    static constexpr int32_t kNbOutputs = 8;

    explicit ResolverPlugin(int32_t page_rows);
    ResolverPlugin(ResolverPlugin const&) = default;

    static ResolverPlugin create(nvinfer1::PluginFieldCollection const* fc);
    static void describe_fields(FieldList& fields);
    void list_fields(FieldList& fields) const;

    int32_t getNbOutputs() const noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
        nvinfer1::DimsExprs const* shapeInputs, int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs,
        int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;

private:
    int32_t mPageRows;
};

} // namespace trt
} // namespace dhisparse
